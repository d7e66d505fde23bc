"""A Ctrl-C that C code turned into another error still ends the command as interrupted.

An extension module's init that a SIGINT interrupts can replace the KeyboardInterrupt with an error of its own:
numpy's `_multiarray_umath`, interrupted while it imports `datetime`, raises `ImportError: PyCapsule_Import could
not import module "datetime"`, and the KeyboardInterrupt is gone. `kvfleet witness` interrupted at that moment
printed that traceback and exited 1 (found by the suite: tests/fleet/cli/test_cli_interrupt_any.py). The signals
here are real; what stands in for the C code is an `except KeyboardInterrupt` that raises another error, as numpy's
init does.
"""

from __future__ import annotations

import os
import signal

import pytest

from fleet.app.cli.sigint import sigint_as_interrupt


def _interrupted_init() -> None:
    """A real SIGINT, arriving in code that turns it into another error."""
    try:
        os.kill(os.getpid(), signal.SIGINT)  # its Python handler runs before the next bytecode
    except KeyboardInterrupt:
        raise ImportError('PyCapsule_Import could not import module "datetime"') from None


def test_control_without_it_the_converted_error_is_what_escapes() -> None:
    with pytest.raises(ImportError):
        _interrupted_init()


def test_a_sigint_turned_into_another_error_ends_as_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt) as info, sigint_as_interrupt():
        _interrupted_init()
    assert isinstance(info.value.__cause__, ImportError)  # what the C code raised stays on the chain
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_sigint_swallowed_inside_still_ends_the_block() -> None:
    """An optional import that catches ImportError would go on as if no Ctrl-C had come."""
    with pytest.raises(KeyboardInterrupt), sigint_as_interrupt():
        try:
            _interrupted_init()
        except ImportError:
            pass


def test_an_error_with_no_sigint_is_left_as_it_is_and_the_handler_restored() -> None:
    with pytest.raises(ImportError), sigint_as_interrupt():
        raise ImportError("a real missing module")
    with sigint_as_interrupt():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_its_own_is_left_alone() -> None:
    """asyncio.run and the commands' own handlers install theirs only over Python's default: it must not be
    replaced where it is not the default, nor left replaced after."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with sigint_as_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
