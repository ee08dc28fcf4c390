"""Dissociated IPC URIs: parsing, building, round trips, and rejection of malformed input."""

from __future__ import annotations

import base64
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dissoc.uri
from dissoc.errors import DissocError
from dissoc.uri import (
    DEFAULT_SCHEMES,
    MEMORY_KINDS,
    RESERVED_PARAMS,
    DissocURI,
    UriError,
    known_schemes,
    register_scheme,
)

U64_MAX = 2**64 - 1


def test_error_type() -> None:
    assert issubclass(UriError, DissocError)
    assert issubclass(UriError, ValueError)


def test_parse_minimal() -> None:
    u = DissocURI.parse("tcp://127.0.0.1:9000?want_data=42")
    assert u == DissocURI("tcp", "127.0.0.1", 9000, 42)
    assert (u.free_data, u.remote_handle, u.memory, u.params) == (None, None, None, {})
    assert u.address == ("127.0.0.1", 9000)
    assert str(u) == "tcp://127.0.0.1:9000?want_data=42"
    assert u.to_string() == str(u)


def test_parse_everything() -> None:
    handle = b"\xfb\xff\x00psm_dissoc_1"
    b64 = base64.b64encode(handle).decode()
    text = f"ucx://host-1.example:1234?want_data=1&free_data=2&remote_handle={b64}&memory=cuda&worker=abc%3D"
    u = DissocURI.parse(text)
    assert u.scheme == "ucx"
    assert u.host == "host-1.example"
    assert u.port == 1234
    assert (u.want_data, u.free_data) == (1, 2)
    assert u.remote_handle == handle
    assert u.memory == "cuda"
    assert u.params == {"worker": "abc="}
    assert DissocURI.parse(str(u)) == u


def test_canonical_string_percent_encodes_the_handle() -> None:
    u = DissocURI("tcp", "h", 1, 5, remote_handle=b"\xfb\xef\xff")  # base64 "++//"
    assert str(u) == "tcp://h:1?want_data=5&remote_handle=%2B%2B%2F%2F"
    assert DissocURI.parse(str(u)).remote_handle == b"\xfb\xef\xff"


@pytest.mark.parametrize(
    "encoded",
    ["%2B%2B%2F%2F", "++//", "--__", "-+_/", "%2b%2b%2f%2f"],
)
def test_remote_handle_alphabets(encoded: str) -> None:
    assert DissocURI.parse(f"tcp://h:1?want_data=0&remote_handle={encoded}").remote_handle == b"\xfb\xef\xff"


@pytest.mark.parametrize(
    ("encoded", "expected"),
    [("aGk", b"hi"), ("aGk=", b"hi"), ("aGk%3D", b"hi"), ("YQ", b"a"), ("YQ==", b"a"), ("", b"")],
)
def test_remote_handle_padding_optional(encoded: str, expected: bytes) -> None:
    assert DissocURI.parse(f"tcp://h:1?want_data=0&remote_handle={encoded}").remote_handle == expected


@pytest.mark.parametrize("bad", ["a", "abcde", "ab=c", "a$bc", "%00abc", "ab cd", "YQ=a"])
def test_remote_handle_rejects_bad_base64(bad: str) -> None:
    with pytest.raises(UriError):
        DissocURI.parse(f"tcp://h:1?want_data=0&remote_handle={bad}")


def test_ipv6() -> None:
    u = DissocURI.parse("tcp://[::1]:80?want_data=3")
    assert u.host == "::1"
    assert u.address == ("::1", 80)
    assert str(u) == "tcp://[::1]:80?want_data=3"
    z = DissocURI.parse("ucx://[fe80::1%25eth0]:80?want_data=3")
    assert z.host == "fe80::1%eth0"
    assert str(z) == "ucx://[fe80::1%25eth0]:80?want_data=3"
    assert DissocURI.parse(str(z)) == z


def test_scheme_is_case_insensitive_and_trailing_slash_allowed() -> None:
    assert DissocURI.parse("TCP://h:1/?want_data=1") == DissocURI("tcp", "h", 1, 1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", 0), ("007", 7), (str(U64_MAX), U64_MAX), ("0" * 30 + "5", 5)],
)
def test_u64_values(value: str, expected: int) -> None:
    u = DissocURI.parse(f"tcp://h:1?want_data={value}&free_data={value}")
    assert u.want_data == expected
    assert u.free_data == expected


@pytest.mark.parametrize(
    "bad", ["-1", "+1", "1.0", "0x10", "1e3", "", " 1", str(U64_MAX + 1), "9" * 25, "١٢"]
)
@pytest.mark.parametrize("param", ["want_data", "free_data"])
def test_bad_u64_values(param: str, bad: str) -> None:
    other = "free_data=1" if param == "want_data" else "want_data=1"
    with pytest.raises(UriError, match=param):
        DissocURI.parse(f"tcp://h:1?{other}&{param}={bad}")


@pytest.mark.parametrize("kind", sorted(MEMORY_KINDS))
def test_memory_kinds(kind: str) -> None:
    assert DissocURI.parse(f"tcp://h:1?want_data=1&memory={kind}").memory == kind


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("http://h:1?want_data=1", "expected one of inproc, mem, tcp, tls, ucx.*'http'"),
        ("h:1?want_data=1", "SCHEME://HOST:PORT"),
        ("tcp://h:1", "want_data"),
        ("tcp://h:1?free_data=2", "want_data"),
        ("tcp://h:1?want_data=1&want_data=2", "once"),
        ("tcp://h:1?want_data=1&memory=gpu", "memory"),
        ("tcp://h:1?want_data=1&memory=", "memory"),
        ("tcp://h?want_data=1", "no port"),
        ("tcp://h:?want_data=1", "port"),
        ("tcp://h:65536?want_data=1", "port"),
        ("tcp://h:-1?want_data=1", "port"),
        ("tcp://h:1x?want_data=1", "port"),
        ("tcp://:1?want_data=1", "host"),
        ("tcp://::1:80?want_data=1", "brackets"),
        ("tcp://[::1?want_data=1", r"']'"),
        ("tcp://[::1]?want_data=1", "PORT"),
        ("tcp://[]:1?want_data=1", "IPv6"),
        ("tcp://[not:an:address]:1?want_data=1", "IPv6"),
        ("tcp://user@h:1?want_data=1", "user"),
        ("tcp://h:1/path?want_data=1", "path"),
        ("tcp://h:1?want_data=1#frag", "fragment"),
        ("tcp://h h:1?want_data=1", "spaces"),
        ("tcp://h:1?want_data=1\n", "control"),
        ("tcp://h!:1?want_data=1", "host"),
        ("tcp://h:1?want_data=1&novalue", "name=value"),
        ("tcp://h:1?want_data=1&=v", "parameter name"),
        ("tcp://h:1?want_data=1&x=%zz", "hex digits"),
        ("tcp://h:1?want_data=1&x=%ff", "UTF-8"),
        ("tcp://h:1?want_data=1&x=1%", "hex digits"),
    ],
)
def test_malformed_uris(text: str, match: str) -> None:
    with pytest.raises(UriError, match=match):
        DissocURI.parse(text)


def test_non_string_input() -> None:
    with pytest.raises(UriError, match="expected a string"):
        DissocURI.parse(b"tcp://h:1?want_data=1")  # type: ignore[arg-type]


def test_extra_params_are_kept_and_encoded() -> None:
    u = DissocURI("tcp", "h", 1, 1, params={"a b": "x&y=z", "ü": "/+%"})
    text = str(u)
    assert "a%20b=x%26y%3Dz" in text
    assert DissocURI.parse(text).params == {"a b": "x&y=z", "ü": "/+%"}
    # empty segments are tolerated; order of extra params is kept
    v = DissocURI.parse("tcp://h:1?z=1&&want_data=1&a=2&")
    assert list(v.params) == ["z", "a"]
    assert str(v) == "tcp://h:1?want_data=1&z=1&a=2"


def test_constructor_validation() -> None:
    ok = DissocURI("tcp", "h", 1, 1)
    bad_changes: list[dict[str, object]] = [
        {"scheme": "TCP"},
        {"scheme": "nope"},
        {"host": ""},
        {"host": "bad host"},
        {"host": "1:2:3"},
        {"port": 70000},
        {"port": True},
        {"want_data": -1},
        {"want_data": 2**64},
        {"want_data": True},
        {"free_data": -1},
        {"free_data": 1.5},
        {"remote_handle": "text"},
        {"memory": "disk"},
        {"params": {"want_data": "1"}},
        {"params": {"": "1"}},
        {"params": {"k": 1}},
        {"params": {"k": "\ud800"}},
        {"params": [("k", "v")]},
    ]
    for change in bad_changes:
        with pytest.raises(UriError):
            dataclasses.replace(ok, **change)  # type: ignore[arg-type]


def test_immutable_hashable_and_private_params() -> None:
    params = {"k": "v"}
    u = DissocURI("tcp", "h", 1, 1, remote_handle=bytearray(b"x"), params=params)  # type: ignore[arg-type]
    params["k"] = "changed"
    assert u.params == {"k": "v"}
    assert isinstance(u.remote_handle, bytes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.port = 2  # type: ignore[misc]
    same = DissocURI("tcp", "h", 1, 1, remote_handle=b"x", params={"k": "v"})
    assert u == same
    assert hash(u) == hash(same)
    assert len({u, same}) == 1


def test_register_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dissoc.uri, "_schemes", set(DEFAULT_SCHEMES))  # restored after the test
    assert known_schemes() == DEFAULT_SCHEMES
    with pytest.raises(UriError, match="scheme"):
        DissocURI.parse("testfab://h:1?want_data=1")
    register_scheme("testfab")
    assert "testfab" in known_schemes()
    assert DissocURI.parse("testfab://h:1?want_data=1").scheme == "testfab"
    with pytest.raises(UriError):
        register_scheme("Bad Scheme")


def test_reserved_params_constant() -> None:
    assert set(RESERVED_PARAMS) == {"want_data", "free_data", "remote_handle", "memory"}


# -- properties ----------------------------------------------------------------------------------------------

text_no_surrogates = st.text(st.characters(codec="utf-8"), max_size=12)
hosts = st.one_of(
    st.from_regex(r"[A-Za-z0-9._~-]{1,20}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
)
uris = st.builds(
    DissocURI,
    scheme=st.sampled_from(sorted(DEFAULT_SCHEMES)),
    host=hosts,
    port=st.integers(0, 65535),
    want_data=st.integers(0, U64_MAX),
    free_data=st.none() | st.integers(0, U64_MAX),
    remote_handle=st.none() | st.binary(max_size=40),
    memory=st.none() | st.sampled_from(sorted(MEMORY_KINDS)),
    params=st.dictionaries(
        text_no_surrogates.filter(lambda k: bool(k) and k not in RESERVED_PARAMS),
        text_no_surrogates,
        max_size=3,
    ),
)


@settings(max_examples=200, deadline=None)
@given(uris)
def test_round_trip(u: DissocURI) -> None:
    text = str(u)
    assert text.isascii()
    assert DissocURI.parse(text) == u
    assert str(DissocURI.parse(text)) == text


@settings(max_examples=100, deadline=None)
@given(uris)
def test_url_safe_unpadded_handle_reads_the_same(u: DissocURI) -> None:
    if u.remote_handle is None:
        return
    urlsafe = base64.urlsafe_b64encode(u.remote_handle).decode().rstrip("=")
    text = str(dataclasses.replace(u, remote_handle=None)) + f"&remote_handle={urlsafe}"
    assert DissocURI.parse(text).remote_handle == u.remote_handle


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=60),
        st.builds(lambda s: "tcp://" + s, st.text(max_size=40)),
        st.builds(lambda s: "tcp://h:1?" + s, st.text(max_size=40)),
    )
)
def test_garbage_raises_only_uri_error(text: str) -> None:
    try:
        u = DissocURI.parse(text)
    except UriError as exc:
        assert "expected" in str(exc)
    else:
        assert DissocURI.parse(str(u)) == u
