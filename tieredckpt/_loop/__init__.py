"""The training loop's side: the store it holds, staging copies, signals, RNG, side files, config.
"""
