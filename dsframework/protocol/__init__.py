"""The files a running job writes for its launcher to read: a rank's heartbeat (heartbeat.py), the
goodput timeline (goodput.py), the job's exit codes and its preemption mark (exits.py). Imported by
both the trainer (train/) and the launcher (launching/); pure stdlib.
"""
