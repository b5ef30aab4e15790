"""m2flow: RL training where one driver (the macro flow) runs under any execution plan (the micro flow)."""

__version__ = "0.1.0"
