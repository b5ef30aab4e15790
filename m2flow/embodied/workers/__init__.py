"""The embodied workers: env groups stepping simulators (`env.py`), the policy answering them (`policy.py`) and
the on-policy learner (`actor.py`); SAC's learner lives in `../sac/`."""
