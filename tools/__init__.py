"""Command-line tools around megalite: data preparation, conversion, launchers, checks.

Each module runs as a script (`python tools/x.py --help`); its siblings import as
`tools.x`, which the installed package provides (`pip install -r requirements.txt`).
"""
