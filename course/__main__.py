import signal
import sys


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # SIGTERM: unwind like Ctrl-C, so the check process is killed too


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    from .grader.lock import warn_if_drifted
    warn_if_drifted()                   # one line when this interpreter's versions are not the lock's
    try:
        from .cli import main
        code = main()
    except KeyboardInterrupt:           # Ctrl-C: no traceback; the grader has already killed its check process
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("\n已中止（Ctrl-C）。", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)
