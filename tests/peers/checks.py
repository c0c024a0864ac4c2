"""The check counters every Python test script reports, and the error check they share; free of
PyTorch and JAX imports, so that each test imports only its own framework."""

FAILURES = []
CHECKS = [0]


def expect_error(case, kind, words, fn):
    """`fn()` raises `kind` with every one of `words` in its message."""
    CHECKS[0] += 1
    try:
        fn()
    except kind as e:
        if not all(w in str(e) for w in words):
            FAILURES.append(f"{case}: message {str(e)!r} lacks {words}")
        return
    except Exception as e:  # noqa: BLE001
        FAILURES.append(f"{case}: raised {type(e).__name__}: {e}, expected {kind.__name__}")
        return
    FAILURES.append(f"{case}: no error")
