"""Where a server listens, and who may reach it: the address flags both servers take, the exposure rule (beyond
loopback only with a token), and the URL other machines reach a server by."""

from __future__ import annotations

import argparse
import ipaddress
import socket


def add_address_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """--host, --port and --listen-fd, as both servers take them (`webapp.listen_address` reads them)."""
    parser.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=None, help=f"port to bind (default: {default_port})")
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        metavar="FD",
        help="serve on this inherited descriptor, a TCP socket its starter bound and listens on (so the port is "
        "held before the server starts); its address is the socket's own, so give no --host or --port",
    )


def check_exposure(host: str, token: str | None, token_variable: str) -> None:
    """A server of this project listens beyond loopback only with a token (both servers use this rule)."""
    if token or is_loopback(host):
        return
    raise ValueError(
        f"refusing to listen on {host!r} without a token: set --token or {token_variable}, or bind to 127.0.0.1"
    )


def check_token(token: str | None, named: str) -> None:
    """A bearer token that a client can send: no control character (a newline kept from a file, say) and no
    space at either end, which HTTP drops from a header, so that no request would ever match it. `named`: the
    flag (and variable) it came from."""
    if token and (token != token.strip(" \t") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in token)):
        raise ValueError(
            f"{named} holds a control character (a newline, say) or a space at an end, which no Authorization "
            "header can carry: give it without them"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_url(host: str, port: int) -> str:
    """Where other machines reach a server bound to `host`: the machine's name for a wildcard address."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
