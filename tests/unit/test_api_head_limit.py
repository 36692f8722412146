"""The head bound counts only the request line and headers, never a body read with them."""

from __future__ import annotations

from kvcache_offload_service.head_limit import HeadBudget


def test_a_head_within_the_bound_is_admitted_whole() -> None:
    budget = HeadBudget(64)
    assert budget.admit(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_a_head_over_the_bound_is_refused_across_chunks() -> None:
    budget = HeadBudget(64)
    assert budget.admit(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 30)
    assert not budget.admit(b"a" * 40)


def test_a_body_in_the_same_read_as_a_small_head_is_not_counted() -> None:
    budget = HeadBudget(64)
    assert budget.admit(b"PUT /x HTTP/1.1\r\nContent-Length: 1000\r\n\r\n" + b"b" * 1000)
    budget.head_complete()
    assert budget.admit(b"b" * 100_000)


def test_the_head_end_split_across_reads_is_found() -> None:
    budget = HeadBudget(40)
    assert budget.admit(b"GET / HTTP/1.1\r\nHost: x\r\n\r")
    assert budget.admit(b"\nPUT-body" + b"b" * 100)


def test_each_request_on_a_connection_gets_the_whole_bound() -> None:
    budget = HeadBudget(48)
    head = b"GET / HTTP/1.1\r\nX-A: " + b"a" * 20
    assert budget.admit(head)
    budget.head_complete()
    budget.next_request()
    assert budget.admit(head)
