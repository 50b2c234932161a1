"""Checks the worker scripts share: an AssertionError with a message, and the error a call must raise."""


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def expect_raises(exc, fn, text):
    """`fn()` raises `exc` whose message contains `text`; returns the message."""
    try:
        fn()
    except exc as e:
        expect(text in str(e), f"{exc.__name__} without {text!r}: {e}")
        return str(e)
    raise AssertionError(f"no {exc.__name__} ({text})")
