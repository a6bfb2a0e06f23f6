"""``horovod.run(func, ...)``: a Python function run on every rank, its return values collected.

Horovod's programmatic launcher, on syncdp's: the call starts the ranks exactly as
``horovodrun`` would (:func:`syncdp.launch.run.run`, the same flags as keyword arguments), each rank
calls ``func(*args, **kwargs)``, and the call returns the list of the ranks' return values in
rank order::

    import horovod

    def train(lr):
        import horovod.tensorflow as hvd
        hvd.init()
        ...
        return hvd.rank(), final_loss

    results = horovod.run(train, args=(0.01,), np=2)   # [(0, loss0), (1, loss1)]

How the function and the values travel: the caller listens on a port of its own (on the
interface the job's ranks reach, as the launcher's report channel does), and each rank runs
``python -m syncdp.launch.run_func``, which fetches ``func`` from there, runs it and sends back
what it returned (or the exception it raised). Both directions are signed with a secret made for the
call and given only to the job's processes, in their environment (``SYNCDP_RUN_FUNC_ADDR``,
``SYNCDP_RUN_FUNC_SECRET``), so a job on several hosts needs no shared file system. ``func``,
``args``, ``kwargs`` and the return values are pickled with cloudpickle (so a function defined in
the calling script works), or with pickle where cloudpickle is not installed (then ``func`` must
be importable by name on the ranks).

When ``func`` raises on a rank, that rank sends the exception, the launcher ends the job as for
any failed rank, and the call raises :class:`RunError` naming the rank (the earliest one to
fail), with the rank's exception as its cause.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["run", "RunError"]

ADDRESS_VAR = "SYNCDP_RUN_FUNC_ADDR"
SECRET_VAR = "SYNCDP_RUN_FUNC_SECRET"
_HEADER = struct.Struct("!Q32s")  # payload length, HMAC-SHA256 of the payload
_FETCH, _RESULT, _ERROR = "fetch", "result", "error"
_CONNECT_SECONDS = 60.0


class RunError(RuntimeError):
    """The job that ``horovod.run`` started failed; ``rank`` is the rank named (or None).

    The exception that rank's ``func`` raised, where there was one, is the ``__cause__``.
    """

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def _pickler():
    try:
        import cloudpickle
    except ImportError:
        return pickle
    return cloudpickle


def _send(sock: socket.socket, secret: bytes, obj: Any) -> None:
    payload = _pickler().dumps(obj)
    mac = hmac.new(secret, payload, hashlib.sha256).digest()
    sock.sendall(_HEADER.pack(len(payload), mac) + payload)


def _receive(sock: socket.socket, secret: bytes) -> Any:
    """One signed message; raises ValueError for one whose signature does not check."""
    length, mac = _HEADER.unpack(_read(sock, _HEADER.size))
    payload = _read(sock, length)
    if not hmac.compare_digest(mac, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise ValueError("a message that is not this job's")
    return pickle.loads(payload)  # cloudpickle's output is read by pickle itself


def _read(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Exchange:
    """The caller's end: hands out the function, collects what each rank sends back."""

    def __init__(self, task: bytes, listen_host: str, secret: bytes):
        self._task = task
        self._secret = secret
        self._lock = threading.Lock()
        self.results: dict[int, Any] = {}
        self.errors: dict[int, tuple[float, str, str, BaseException | None]] = {}
        self._server = socket.create_server((listen_host, 0), backlog=128)
        self.port = self._server.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="horovod.run", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_CONNECT_SECONDS)
            try:
                kind, rank, *body = _receive(conn, self._secret)
            except (OSError, ValueError, EOFError, pickle.UnpicklingError, TypeError):
                return  # not this job's, or cut off: nothing to take
            if kind == _FETCH:
                payload = self._task
                mac = hmac.new(self._secret, payload, hashlib.sha256).digest()
                conn.sendall(_HEADER.pack(len(payload), mac) + payload)
                return
            try:
                # The value (or the exception) is pickled apart: one this process cannot read
                # (a class it cannot import) is that rank's error, not a lost answer.
                value = pickle.loads(body[-1])
            except Exception as e:  # noqa: BLE001 - anything unpickling raises, named
                value = None
                if kind == _ERROR:  # the rank's own type and message still stand
                    body = [
                        body[0],
                        f"{body[1]} (the exception itself could not be read here: {e})",
                    ]
                else:
                    kind = _ERROR
                    body = [type(e).__name__, f"its value could not be read here: {e}"]
            with self._lock:
                if kind == _RESULT:
                    self.results[rank] = value
                elif kind == _ERROR:
                    self.errors.setdefault(rank, (time.time(), body[0], body[1], value))
            _send(conn, self._secret, "ok")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()


def _flag_arguments(options: Mapping[str, Any]) -> list[str]:
    """``horovod.run``'s keyword arguments as the launcher's command line."""
    argv: list[str] = []
    valued = {
        "num_proc": "-np",
        "min_num_proc": "--min-np",
        "max_num_proc": "--max-np",
        "slots": "--slots-per-host",
        "reset_limit": "--reset-limit",
        "hosts": "-H",
        "hostfile": "--hostfile",
        "start_timeout": "--start-timeout",
        "ssh_port": "--ssh-port",
        "ssh_identity_file": "--ssh-identity-file",
        "output_filename": "--output-filename",
        "network_interface": "--network-interface",
        "host_discovery_script": "--host-discovery-script",
    }
    for name, flag in valued.items():
        value = options.get(name)
        if value is not None:
            argv += [flag, str(value)]
    if options.get("cooldown_range") is not None:
        low, high = options["cooldown_range"]
        argv += ["--blacklist-cooldown-range", str(low), str(high)]
    if options.get("mpi_args"):
        argv += [f"--mpi-args={options['mpi_args']}"]
    for name, flag in (("disable_cache", "--disable-cache"), ("verbose", "--verbose")):
        if options.get(name):
            argv.append(flag)
    if options.get("use_gloo"):
        argv.append("--gloo")
    if options.get("use_mpi"):
        argv.append("--mpi")
    return argv


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None, extra: Mapping[str, str]):
    """``os.environ`` as the ranks' environment while the job runs (the launcher gives the
    ranks its own): ``env`` where given (else the caller's), plus ``extra``."""
    saved = dict(os.environ)
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in env.items()})
        os.environ.update(extra)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: int | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    env: Mapping[str, str] | None = None,
    host_discovery_script: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` on every rank of a new job; returns the values in rank order.

    Horovod's ``horovod.run`` (also ``horovod.runner.run``): the job is started as
    ``horovodrun`` starts one, and ends when every rank's ``func`` has returned. ``func``
    usually calls ``hvd.init()`` itself.

    Args:
        func: The function; it and its arguments are pickled (cloudpickle where installed).
        args: Positional arguments for ``func``. Defaults to ().
        kwargs: Keyword arguments for ``func``. Defaults to None (none).
        num_proc: The number of ranks (``-np``). Defaults to 1 (``np`` is Horovod's older
            spelling, also accepted).
        min_num_proc, max_num_proc, slots, reset_limit: Elastic mode, as ``--min-np``,
            ``--max-np``, ``--slots-per-host`` and ``--reset-limit`` (``min_np``/``max_np``
            also accepted). Defaults to None.
        cooldown_range: Accepted for Horovod compatibility (syncdp keeps no blacklist).
        hosts: ``"host1:2,host2:2"`` (``-H``). Defaults to None: this host.
        hostfile: A file of ``host slots=N`` lines. Defaults to None.
        start_timeout, ssh_port, ssh_identity_file, disable_cache, output_filename, verbose,
            mpi_args, network_interface, host_discovery_script: As horovodrun's flags of the
            same names. Default to None.
        use_gloo, use_mpi: Accepted: the job runs on syncdp's engine over Open MPI either way
            (at most one may be True, as in Horovod).
        executable: The Python the ranks run. Defaults to ``sys.executable``.
        env: The ranks' environment. Defaults to None: this process's.

    Returns:
        ``func``'s return values, one per rank, in rank order (in elastic mode, one per rank of
        the job as it ended).

    Raises:
        ValueError: Both ``hosts`` and ``hostfile``, or both ``use_gloo`` and ``use_mpi``.
        RunError: A rank's ``func`` raised (the rank is named; its exception is the cause),
            or the job failed before every rank returned (the launcher's output says why).
    """
    from syncdp.launch import cli
    from syncdp.launch import hosts as hosts_module
    from syncdp.launch import run as launcher
    from syncdp.watch import report

    for old, new, value in (("np", "num_proc", np), ("min_np", "min_num_proc", min_np)):
        if value is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, 2)
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, 2)
    num_proc = num_proc if num_proc is not None else (np if np is not None else 1)
    min_num_proc = min_num_proc if min_num_proc is not None else min_np
    max_num_proc = max_num_proc if max_num_proc is not None else max_np
    if hosts is not None and hostfile is not None:
        raise ValueError("horovod.run takes hosts or hostfile, not both.")
    if use_gloo and use_mpi:
        raise ValueError("horovod.run takes use_gloo=True or use_mpi=True, not both.")
    options = {k: v for k, v in locals().items() if k not in ("func", "args", "kwargs")}
    argv = _flag_arguments(options)
    python = executable or sys.executable
    try:
        config = cli.parse_args(argv + [python, "-m", "syncdp.launch.run_func"], prog="horovod.run")
    except SystemExit as e:  # argparse's way out, with its message on stderr
        raise ValueError(f"horovod.run: invalid arguments {argv} (see the line above)") from e
    listen, advertise = hosts_module.job_address(
        hosts_module.listed(config.hosts, config.hostfile) or [],
        network_interfaces=config.network_interfaces,
    )
    # The caller's folders travel outside the function's pickle: a rank adds them to its path
    # before loading the function, which may live in a module of those folders.
    task = pickle.dumps(
        (_caller_paths(), _pickler().dumps((func, tuple(args), dict(kwargs or {}))))
    )
    secret = secrets.token_bytes(32)
    exchange = _Exchange(task, listen, secret)
    try:
        extra = {
            ADDRESS_VAR: report.join_address(advertise, exchange.port),
            SECRET_VAR: secret.hex(),
        }
        with _environment(env, extra):
            code = launcher.run(config)
    finally:
        exchange.close()
    return _outcome(code, exchange, config)


def _caller_paths() -> list[str]:
    """The caller's own folders on ``sys.path`` (its script's), for the ranks to import from."""
    return [p for p in sys.path[:1] if p and os.path.isdir(p)]


def _outcome(code: int, exchange: _Exchange, config) -> list[Any]:
    if exchange.errors:
        rank, (_, kind, text, cause) = min(exchange.errors.items(), key=lambda item: item[1][0])
        error = RunError(f"horovod.run: rank {rank} failed: {kind}: {text}", rank)
        if cause is not None:
            raise error from cause
        raise error
    if code != 0:
        raise RunError(
            f"horovod.run: the job failed (exit status {code}) before every rank returned; the "
            "launcher's output above names the rank and why."
        )
    ranks = sorted(exchange.results)
    if not config.elastic and ranks != list(range(config.num_proc)):
        missing = sorted(set(range(config.num_proc)) - set(ranks))
        raise RunError(f"horovod.run: ranks {missing} ended without returning a value.")
    return [exchange.results[r] for r in ranks]


def _rank() -> int:
    """This rank's number: syncdp's (elastic mode renumbers), else Open MPI's."""
    runtime = sys.modules.get("syncdp.job.runtime")
    if runtime is not None and runtime.is_initialized():
        return runtime.rank()
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def _talk(message: tuple) -> Any:
    secret = bytes.fromhex(os.environ[SECRET_VAR])
    from syncdp.watch import report

    with report.connect(os.environ[ADDRESS_VAR], _CONNECT_SECONDS) as sock:
        _send(sock, secret, message)
        return _receive(sock, secret)


def _main() -> int:
    """A rank: fetch the function, run it, send back its value or its exception."""
    if ADDRESS_VAR not in os.environ or SECRET_VAR not in os.environ:
        print("syncdp.launch.run_func runs on the ranks that horovod.run starts.", file=sys.stderr)
        return 2
    paths, task = _talk((_FETCH, None))
    for path in paths:
        if path not in sys.path:
            sys.path.append(path)
    try:
        func, args, kwargs = pickle.loads(task)
    except Exception as e:
        what = f"the function or its arguments could not be loaded on the rank: {e}"
        _talk((_ERROR, _rank(), type(e).__name__, what, _dumps(None)))
        raise
    try:
        value = func(*args, **kwargs)
    except BaseException as e:
        text = str(e).strip().splitlines()
        _talk((_ERROR, _rank(), type(e).__name__, text[-1] if text else "", _dumps(e)))
        raise
    try:
        value_bytes = _pickler().dumps(value)
    except Exception as e:
        what = f"func returned a {type(value).__name__}, which cannot be pickled: {e}"
        _talk((_ERROR, _rank(), type(e).__name__, what, _dumps(None)))
        raise
    _talk((_RESULT, _rank(), value_bytes))
    return 0


def _dumps(error: BaseException | None) -> bytes:
    """``error`` pickled, or None pickled where it does not pickle (its text travels anyway)."""
    try:
        return _pickler().dumps(error)
    except Exception:  # noqa: BLE001 - whatever a foreign exception's pickling raises
        return _pickler().dumps(None)


if __name__ == "__main__":
    sys.exit(_main())
