"""The reasoning recipe's wing (GRPO/PPO on a causal LM): what only this recipe uses, above the core (runtime,
algorithms, engines, scheduler) and below the API. Its parts are moving in from workers/, workloads/, flows/ and
planning/; docs/architecture.md tells what lives where."""
