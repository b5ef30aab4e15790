"""SAC in the embodied wing: the learner worker (`learner.py`), its replay buffer (`replay.py`) and the opt-in
process-parallel actor update (`actor_process.py`)."""
