"""Access to ucxx: its low-level module, loaded on first use with the environment left as it was; the
process's UCX context; small helpers around ucxx objects (see :mod:`dissoc.transport.ucx`, "Environment").

ucxx ships no type information, so its objects are ``Any`` here and in the other modules of the package.
"""

from __future__ import annotations

import contextlib
import logging
import os
from types import ModuleType
from typing import Any

from dissoc.buffers import BytesLike
from dissoc.errors import TransportError
from dissoc.transport.ucx.libucp import ucs_log_defaults

__all__ = ["close_endpoint", "endpoint_alive", "ucx_array", "ucx_context", "ucx_mask", "ucx_tag", "ucxx_lib"]

logger = logging.getLogger(__name__)

_lib_module: ModuleType | None = None
_contexts: dict[str, Any] = {}
# ucxx's Array, UCXXTag and UCXXTagMask classes, looked up once (on the per-message path).
_array_class: Any = None
_tag_class: Any = None
_mask_class: Any = None


def ucxx_lib() -> ModuleType:
    """ucxx's low-level module, imported on first use (see the package docstring about the environment)."""
    global _lib_module
    if _lib_module is None:
        before = dict(os.environ)
        try:
            with ucs_log_defaults():
                import ucxx._lib.libucxx as libucxx
        except ImportError as exc:
            raise TransportError(
                f"the 'ucx' transport needs ucxx (pip install 'dissoc[ucx]'): {exc}"
            ) from exc
        finally:
            _restore_environment(before)
        _lib_module = libucxx
    return _lib_module


#: What importing ucxx put into ``os.environ`` (then taken out again): UCX settings, without the prefix.
_UCXX_SETTINGS: dict[str, str] = {}


def _restore_environment(before: dict[str, str]) -> None:
    """Undo what importing ucxx did to ``os.environ``, keeping its UCX choices for our contexts' config."""
    for key in [k for k in os.environ if k not in before]:
        value = os.environ.pop(key)
        if key.startswith("UCX_"):
            _UCXX_SETTINGS[key[4:]] = value
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


#: Extra configuration of every context (see :func:`ucx_context`): messages up to 64 KiB go eagerly.
EAGER_CONFIG = {"RNDV_THRESH": "65536"}
#: Extra configuration of the context for the listener path's workers (see :func:`ucx_context`).
LISTENER_CONFIG = {"RNDV_SCHEME": "put_zcopy", **EAGER_CONFIG}


def ucx_context(kind: str = "default") -> Any:
    """The process's UCX context of ``kind`` (tag matching, active messages, wake-up, RMA), created once.

    Messages up to 64 KiB go eagerly rather than by rendezvous in every context (``EAGER_CONFIG``; ucxx's
    8 KiB threshold cost a round trip between the two processes per small body: over shared memory the
    sender then waits for the receiver's answer before each body moves, over TCP a round trip too; 16 KiB
    batches moved at about two thirds of the rate on the same-host path, half over TCP). ``"listener"``: the
    listener path's (the listener's worker and the workers its connections are accepted on, a client's
    listener-path worker). Those endpoints run over TCP here, where UCX's put-based rendezvous doubles large
    messages' throughput (``LISTENER_CONFIG``); set for the whole process the rendezvous scheme slowed the
    same-host path's shared memory, hence a context of their own. ``UCX_RNDV_SCHEME``/``UCX_RNDV_THRESH``
    override both. (Eager or not is the sender's choice: a peer's messages reach a server the way the peer's
    own UCX settings send them.) The listener path's context also has the stream API, for ucxx's peer
    information.
    """
    context = _contexts.get(kind)
    if context is None:
        lib = ucxx_lib()
        features: tuple[Any, ...] = (lib.Feature.TAG, lib.Feature.AM, lib.Feature.WAKEUP, lib.Feature.RMA)
        if kind == "listener":
            # ucxx's peer information travels on the stream API (dissoc.transport.ucx.peer_info)
            features += (lib.Feature.STREAM,)
        # Without cma: UCX aborts a process whose cma read fails because the peer died mid-transfer (the data
        # endpoints have no peer-failure handling); shared memory still carries the data. UCX_TLS overrides.
        config = {} if "UCX_TLS" in os.environ else {"TLS": "^cma"}
        extra = LISTENER_CONFIG if kind == "listener" else EAGER_CONFIG
        config.update({k: v for k, v in extra.items() if f"UCX_{k}" not in os.environ})
        if kind == "listener" and "UCX_TCP_CM_REUSEADDR" not in os.environ:
            # A server restarted on its port must be able to listen there again while the connections of
            # the one before linger in TIME_WAIT (as dissoc's TCP listeners can: SO_REUSEADDR).
            config["TCP_CM_REUSEADDR"] = "y"
        # ucxx's own defaults (they were environment variables; UCX_* set by the user still win).
        settings = {k: v for k, v in _UCXX_SETTINGS.items() if f"UCX_{k}" not in os.environ}
        try:
            context = lib.UCXContext({**settings, **config}, features)
        except Exception:
            logger.debug("UCX context with ucxx's settings %s failed; without them", settings, exc_info=True)
            try:
                context = lib.UCXContext(config, features)
            except Exception as exc:
                raise TransportError(f"cannot create a UCX context: {exc}") from exc
        _contexts[kind] = context
    return context


def ucx_array(obj: BytesLike) -> Any:
    """ucxx's view of a host or device buffer, as its send and receive calls take it (no copy)."""
    global _array_class
    if _array_class is None:
        ucxx_lib()
        from ucxx._lib.arr import Array

        _array_class = Array
    return _array_class(obj)


def ucx_tag(value: int) -> Any:
    """A UCX tag, as ucxx's tag calls take it."""
    global _tag_class
    if _tag_class is None:
        _tag_class = ucxx_lib().UCXXTag
    return _tag_class(value)


def ucx_mask(value: int) -> Any:
    """A UCX tag mask, as ucxx's tag calls take it."""
    global _mask_class
    if _mask_class is None:
        _mask_class = ucxx_lib().UCXXTagMask
    return _mask_class(value)


def endpoint_alive(endpoint: Any) -> bool:
    """Whether UCX still considers ``endpoint`` usable (False when asking fails)."""
    try:
        return bool(endpoint.alive)
    except Exception:
        return False


def close_endpoint(endpoint: Any) -> None:
    """Start closing an endpoint unless UCX already closed it (closing a failed ucxx endpoint crashes)."""
    with contextlib.suppress(Exception):
        endpoint.remove_close_callback()
    if endpoint_alive(endpoint):
        with contextlib.suppress(Exception):
            endpoint.close()
