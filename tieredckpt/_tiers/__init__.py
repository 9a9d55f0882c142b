"""Where checkpoints live and how they move: the local run directory, the remote, the
commit protocol, uploads, retention, restores, many ranks.
"""
