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
        _check_bind(args.host, args.port)  # before anything is made or said
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
        except OSError as exc:  # (taken since the check)
            raise _bind_error(args.host, args.port, exc) from None
        return 0


def _check_bind(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go: a host that is no address of this machine, or a
    port in use, is one line before the server says it listens."""
    import socket

    # the server (bottle's wsgiref) binds IPv6 for an address with ':', else IPv4
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        _, kind, proto, _, address = socket.getaddrinfo(
            host, port, family=family, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind(address)
    except OSError as exc:
        raise _bind_error(host, port, exc) from None


def _bind_error(host: str, port: int, exc: OSError) -> Exception:
    import errno
    import socket

    from autoscale.errors import ConfigError

    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        fix = "give --host an address of this machine (127.0.0.1; 0.0.0.0 for every interface)"
    else:
        fix = "try another --port"
    return ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc}; {fix}")
