"""The plans the embodied flow can run on N devices: the search's env/rollout/actor layouts x env pipeline stages,
kept where the flow can launch them (one worker of each component per device, or two env workers per device
where the profile measured them). Pure: it runs nothing.
"""

from __future__ import annotations

import dataclasses

from m2flow.planner.profile import Profile
from m2flow.planner.search import Candidate, SearchResult, search

COMPONENTS = ("env", "rollout", "actor")  # the embodied flow's components, in data order


def runnable(c: Candidate, num_envs: int) -> bool:
    """The flow can launch it: no offload (the flow does not context-switch); every env worker gets the same number of
    envs, split into equal stages; no policy worker without an env worker (env worker r asks policy r % R). Env
    workers: one per device, or `loop_ranks` per device (`env: 0-1:0-3`)."""
    env, rollout = c.layout.devices("env") * c.loop_ranks, c.layout.devices("rollout")
    per_worker = num_envs // env
    return (not c.offload and num_envs % env == 0 and per_worker % c.loop_stages == 0 and env % rollout == 0)


class OneLearnerCandidate(Candidate):
    """A candidate placed as the off-policy flow runs it: the actor (SAC's learner, one rank) one process over its
    devices (`actor: 0-1:0`), env and rollout as the search placed them."""

    @property
    def spec(self) -> str:
        """E.g. the collocated layout on 2 devices -> `env,rollout: 0-1; actor: 0-1:0`."""
        return self.layout.spec({**self.ranks(), "actor": 1})


def embodied_plans(profile: Profile, num_devices: int, num_envs: int | None = None, top: int = 1 << 30,
                   staleness: int = 0, one_learner: bool = False) -> SearchResult:
    """The plans the embodied flow can run on `num_devices` devices for `num_envs` envs (default: the profile's
    batch), fastest predicted first (one row per layout, stage count and env workers per device), and the fastest
    collocated one. A candidate's `spec` launches it: one worker per device for each component, or two env workers
    per device where the profile measured them (env worker r asks policy worker r % R; the actor ranks are
    data-parallel), or with `one_learner` (SAC) the actor one process over its devices.
    `staleness` (sac.max_policy_lag): >= 1 lets the next iteration's collection overlap this one's update wherever the
    actor has devices of its own."""
    if tuple(profile.stages) != COMPONENTS or tuple(profile.loop) != COMPONENTS[:2]:
        raise ValueError(f"{profile.source}: an embodied profile with stages {list(COMPONENTS)} and loop "
                         f"{list(COMPONENTS[:2])} is needed, got stages {list(profile.stages)}, "
                         f"loop {list(profile.loop)}")
    num_envs = num_envs or profile.batch
    result = search(profile, num_devices, top=1 << 30, components=list(COMPONENTS), batch=num_envs, staleness=staleness)
    keep = [c for c in result.candidates if runnable(c, num_envs)]
    if one_learner:
        keep = [OneLearnerCandidate(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}) for c in keep]
    collocated = next((c for c in keep if c.mode == "collocated"), None)
    return dataclasses.replace(result, candidates=keep[:top], collocated=collocated)
