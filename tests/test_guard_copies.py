"""The guard against routes around it: copies of labkit's code, answers in another form, other machines and days.

tests/test_grading.py proves each checker on the solutions, the stubs and the wrong answers of
tests/wrong_answers.py; these prove the parts those runs rest on: that a copy of a refused function refuses however
it was loaded (and nothing else does), that exercise 13 takes positions in any form a caller can use, that exercise
12's other machines and days are other ones, and that the new checks say what went wrong in the student's terms.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import inspect
import os
import platform
import socket
import sys
import time
import types
import uuid

import pytest
import torch

import labkit.collectives
import labkit.loader
import labkit.parallel.experts.permute
from labkit import grading
from labkit.grading import copies, guard
from labkit.grading.checkers import another_machine
from labkit.grading.checkers import long_context as long_context_checks
from tests.conftest import REPO
from tests.wrong_answers import BY_NAME

LIBRARY = guard.LABKIT_IMPLEMENTATIONS


def _refused(library: tuple[str, ...]):
    """What a check over ``library`` enters: copies of its refused functions refuse (the guard's swap itself aside)."""
    return copies.refused(copies.Refused.of(guard._refusals(library, (), guard.DEFAULT_REASON), []), guard.swap_code)


def _source_run_into_a_dict(path: str) -> dict:
    namespace: dict = {}
    exec(compile(open(path).read(), "<copied>", "exec"), namespace)  # the shortcut refused below
    return namespace


def test_a_copy_of_labkits_code_refuses_however_it_was_loaded_and_works_again_after(tmp_path):
    made_before = _source_run_into_a_dict(labkit.loader.__file__)["sample_seed"]  # a student's file, at import
    code = labkit.parallel.experts.permute.inverse_permutation.__code__
    expected = made_before(1, 2, 3, 4)
    with _refused(LIBRARY):
        with pytest.raises(guard.Forbidden, match=r"used a copy of labkit\.loader\.sample_seed, labkit's own"):
            made_before(1, 2, 3, 4)  # made before the block: swapped
        with pytest.raises(guard.Forbidden, match=r"ran <copied> again, which holds a copy of labkit\.loader\."):
            _source_run_into_a_dict(labkit.loader.__file__)
        with pytest.raises(guard.Forbidden, match=r"a copy of labkit\.parallel\.experts\.permute\.inverse_perm"):
            types.FunctionType(code, {})  # exercise 14's: the same hook, whatever the exercise
        spec = importlib.util.spec_from_file_location("unregistered", labkit.parallel.experts.permute.__file__)
        with pytest.raises(guard.Forbidden, match=r"permute\.py again"):
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        mine: dict = {}
        exec("def inverse_permutation(order):\n    return order.argsort()\n", mine)  # the same name, other code
        assert mine["inverse_permutation"](torch.tensor([2, 0, 1])).tolist() == [1, 2, 0]
        (tmp_path / "answer.py").write_text(f"import torch\n\n\n{inspect.getsource(labkit.parallel.experts.permute.inverse_permutation)}")
        spec = importlib.util.spec_from_file_location("answer", tmp_path / "answer.py")
        answer = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(answer)  # a student's own file that reads as labkit's does: the student's
        assert answer.inverse_permutation(torch.tensor([2, 0, 1])).tolist() == [1, 2, 0]
    assert made_before(1, 2, 3, 4) == expected == labkit.loader.sample_seed(1, 2, 3, 4)


def test_a_copy_of_torchs_code_named_by_a_check_refuses_too():
    library = LIBRARY + long_context_checks.BUILT_INS
    balancer = sys.modules["torch.distributed.tensor.experimental._context_parallel._load_balancer"]
    copy = _source_run_into_a_dict(balancer.__file__)["_HeadTailLoadBalancer"]
    with _refused(library), pytest.raises(guard.Forbidden, match="_HeadTailLoadBalancer.__init__, a built-in"):
        copy(8, 2, "cpu")


def test_code_a_decorator_lends_to_a_refused_function_is_not_refused_elsewhere():
    """labkit.collectives has a @contextmanager function: its code is contextlib's helper, which every
    @contextmanager function in the process runs; only the function itself is refused, never the helper."""
    @contextlib.contextmanager
    def mine():
        yield 7

    _source_run_into_a_dict(labkit.collectives.__file__)  # a copy made: the block lists every function
    assert copies._MADE_OUTSIDE
    with _refused(LIBRARY), mine() as value:
        assert value == 7


def test_the_positions_a_caller_can_use_pass_in_any_form(tmp_path):
    solution = (REPO / "solutions" / "13_long_context.py").read_text()
    loop = ("    positions = []\n    for index in (rank, chunks - 1 - rank):  # an early chunk and its mirror from the end\n"
            "        positions += range(index * chunk, (index + 1) * chunk)\n    return positions\n")
    forms = {"tensor": "    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (rank, chunks - 1 - rank)])\n",
             "tuple": "    return tuple(p for i in (rank, chunks - 1 - rank) for p in range(i * chunk, (i + 1) * chunk))\n"}
    for form, body in forms.items():
        path = tmp_path / form / "13_long_context.py"
        path.parent.mkdir()
        path.write_text(solution.replace(loop, body))
        for check in (long_context_checks.check_zigzag, long_context_checks.check_ring):
            result = grading.run_check(check, path)
            assert result.passed, (form, result.message)


def test_another_machine_reports_another_host_and_day_and_puts_this_one_back():
    here = (socket.gethostname(), platform.node(), os.uname().nodename, uuid.getnode(), datetime.date.today())
    for _what, host, days in another_machine.SITUATIONS[1:]:
        with another_machine.pretend(host, days):
            if host is not None:
                assert socket.gethostname() == platform.node() == os.uname().nodename == socket.getfqdn() == host
                assert uuid.getnode() != here[3] and os.environ["HOSTNAME"] == host
                if os.path.exists("/proc/sys/kernel/hostname"):
                    assert open("/proc/sys/kernel/hostname").read().strip() == host
            else:
                assert datetime.date.today() == here[4] + datetime.timedelta(days=days)
                assert datetime.datetime.now().date() == here[4] + datetime.timedelta(days=days)
                assert time.localtime().tm_yday != time.localtime(time.time() - days * 86400).tm_yday
    assert (socket.gethostname(), platform.node(), os.uname().nodename, uuid.getnode(),
            datetime.date.today()) == here


@pytest.mark.parametrize("name, check, hints", [
    ("input_host_name", 2, ["that reports the host name 'labkit-node-7'", "depends on the machine"]),
    ("input_date", 2, ["that runs 9 days later", "depends on the date"]),
    ("input_string_hash", 2, ["that runs on this host, today", "salted per process"]),
    ("input_numpy_uint64", 0, ["(numpy.uint64); expected an int", "manual_seed takes a Python int only"]),
    ("input_40_bits", 1, ["are the same in all 4,496,149 seeds: they use 40 of the 63 bits"]),
    ("input_40_bits_spread", 1, ["both returned", "a hash of fewer than 63 bits collides by chance"]),
    ("long_zigzag_generator", 1, ["returned a generator (an iterator, which can be read only once)"]),
    ("long_zigzag_float_positions", 1, ["returned a list holding 0.0 (float)"]),
    ("long_merge_view_flat", 0, ["laid out transposed (not contiguous) raised RuntimeError", "not .view"]),
    ("long_blockwise_arange_on_cpu", 2, ["on the meta device raised RuntimeError", "device=q.device"]),
    ("long_blockwise_lse_float64", 2, ["in float32 returned out of torch.float64", "dtype=q.dtype"]),
    ("long_zigzag_torch_head_tail", 1, ["_HeadTailLoadBalancer.__init__, a built-in"]),
    ("long_merge_torch_sdpa_merger", 0, ["_SDPAMerger.__init__, a built-in"]),
])
def test_the_new_checks_say_what_went_wrong_in_the_students_terms(name, check, hints, tmp_path):
    answer = BY_NAME[name]
    checks = importlib.import_module(grading.EXERCISES[answer.topic][1]).CHECKS
    result = grading.run_check(checks[check], answer.write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message
