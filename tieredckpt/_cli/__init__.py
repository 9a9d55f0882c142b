"""The command line's parts: cli.py is the entry point and the commands that fit on a page."""
