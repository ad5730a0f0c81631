"""VLA environments: the vectorized chunk interface (base.py), subprocess workers with shared-memory observations
(subproc.py, subproc_worker.py), the built-in reach-and-push task (reach_push.py) and adapters for ManiSkill 3 and
LIBERO (maniskill.py, libero.py; unverified: neither package is installed here)."""
