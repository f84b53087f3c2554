"""Pipeline parallelism: point-to-point exchange (comm.py) and 1F1B / interleaved schedules (schedules.py)."""
