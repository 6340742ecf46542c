"""``autoscale dashboard``: optuna-dashboard on a search storage, with its artifacts."""

from __future__ import annotations

import argparse

from autoscale.commands.base import Command


class DashboardCommand(Command):
    """Serve optuna-dashboard on a search storage (trials, notes, plots); local only by default."""

    epilog = """examples:
  autoscale dashboard                                  the default storage, http://127.0.0.1:8080
  autoscale dashboard --storage runs.log --port 9000
  autoscale dashboard --storage postgresql://user@db-host/autoscale --artifacts /shared/artifacts

It binds 127.0.0.1: reach it from another machine through an SSH tunnel
(ssh -L 8080:127.0.0.1:8080 HOST), or pass --host 0.0.0.0 on a trusted network only.
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from autoscale.commands.search import add_storage_arguments

        add_storage_arguments(parser)
        parser.add_argument("--port", type=int, default=8080, help="default 8080")
        parser.add_argument(
            "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)"
        )

    def run(self, args: argparse.Namespace) -> int:
        from optuna_dashboard import run_server

        from autoscale.errors import ConfigError
        from autoscale.search.storage import artifact_store, artifacts_dir, mask_url, open_storage

        if not 0 < args.port < 65536:
            raise ConfigError(f"--port must be a TCP port from 1 to 65535, got {args.port}")
        storage = open_storage(args.storage, must_exist=True)
        store = artifact_store(artifacts_dir(args.storage, args.artifacts))
        print(
            f"optuna-dashboard on {mask_url(args.storage)}: http://{args.host}:{args.port}/ (Ctrl-C stops it)"
        )
        import os
        import signal
        import sys

        def stop(signum, frame):
            # wsgiref catches every exception inside a request (a bare except), so a Ctrl-C that
            # lands while a request is served would be swallowed and the server would go on:
            # leave at once instead (the dashboard holds nothing that needs flushing).
            print("stopped", flush=True)
            sys.stderr.flush()
            os._exit(0)

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            run_server(storage, host=args.host, port=args.port, artifact_store=store)
        except KeyboardInterrupt:
            print("stopped")
        except OSError as exc:
            raise ConfigError(
                f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}; try another --port"
            ) from None
        return 0
