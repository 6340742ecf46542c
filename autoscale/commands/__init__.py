"""One module per ``autoscale`` subcommand (see ``autoscale/cli.py``)."""
