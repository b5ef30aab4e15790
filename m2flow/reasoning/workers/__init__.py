"""The reasoning workers, one per component of the flow: rollout (generation), reward, inference (reference and
behaviour log-probs), critic, actor, tool; `policy_copy.py` is how rollout and inference take synced weights."""
