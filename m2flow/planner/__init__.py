"""The planner: profile tables (`profile.py`), the cost model fitted to them (`cost.py`), the search over
placements and granularities (`search.py`), the plan a flow runs (`plan.py`) and its predicted timeline
(`timeline.py`). Pure: it reads profiles and placements, never executes, and imports no wing."""
