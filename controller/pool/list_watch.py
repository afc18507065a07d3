"""One kind of object in a namespace, kept current from the API server by a list and then a watch
(client-go's reflector, in small), so that readers take it from memory, not with a request each.

A thread lists the objects (their resourceVersion with them), then watches from there: every
event updates the cache at once, and a quiet watch costs the API server nothing but an open
connection (the server ends it after WATCH_S; the thread watches again from the last version).
An expired version (410 Gone) or a dropped connection makes it list again. Where the caller may
list but not watch (an older Role: 403 on the watch), it lists every `period_s` instead, which is
what serving did before (two GETs a second per replica). `objects()` answers from the cache; it
raises ListWatchError until a first list has succeeded (the caller may fall back to a request).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

WATCH_S = 60  # the server ends each watch after this long; the thread resumes from the last version
GONE, FORBIDDEN = 410, 403


class ListWatchError(RuntimeError):
    """The objects were never listed (the message says why: RBAC, the API server, a timeout)."""


class ListWatch:
    """list_call(*args, **selector): a kubernetes client list method (e.g. CoreV1Api.list_namespaced_pod
    with the namespace in args and label_selector in selector); the cache maps name -> object (a dict)."""

    def __init__(self, list_call: Callable[..., Any], *args: Any, period_s: float = 1.0, what: str = "objects",
                 **selector: Any):
        self.list_call, self.args, self.selector = list_call, args, selector
        self.period_s, self.what = period_s, what
        self.lists = 0  # lists made (one at start and after each expiry or error; each period where not watching)
        self.watching = True  # False once the API server refused a watch (then it lists every period_s)
        self._objects: dict[str, dict] | None = None
        self._error = "not listed yet"
        self._lock = threading.Lock()
        self._tried = threading.Event()  # the first list has succeeded or failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"list-watch-{what}", daemon=True)
        self._thread.start()

    def objects(self, wait_s: float = 5.0) -> list[dict]:
        """The objects now (waiting up to wait_s for the first list); ListWatchError before one succeeded."""
        self._tried.wait(wait_s)
        with self._lock:
            if self._objects is None:
                raise ListWatchError(f"cannot list {self.what}: {self._error}")
            return list(self._objects.values())

    def close(self) -> None:
        """Stop following (the thread ends when its watch does; it holds nothing else)."""
        self._stop.set()

    def _run(self) -> None:
        from kubernetes.client.rest import ApiException  # the kubernetes client: only where a pool is followed

        while not self._stop.is_set():
            try:
                version = self._list()
                if self.watching:
                    self._watch(version)
                else:
                    self._stop.wait(self.period_s)
            except ApiException as err:
                if err.status != GONE:  # an expired version: list again at once
                    # A Role without `list` stays so for a while: try again in a minute, not every period.
                    self._failed(f"{err.status} {err.reason}", 60.0 if err.status == FORBIDDEN else self.period_s)
            except Exception as err:  # the API server restarting, a dropped connection: list again shortly
                self._failed(f"{type(err).__name__}: {err}", self.period_s)

    def _failed(self, why: str, wait_s: float) -> None:
        with self._lock:
            self._error = why
        self._tried.set()
        log.debug("list-watch of %s: %s; listing again in %g s", self.what, why, wait_s)
        self._stop.wait(wait_s)

    def _list(self) -> str:
        reply = self.list_call(*self.args, **self.selector, _preload_content=False, _request_timeout=10)
        doc = json.loads(reply.data)
        with self._lock:
            self._objects = {o["metadata"]["name"]: o for o in doc.get("items") or ()}
        self.lists += 1
        self._tried.set()
        return doc["metadata"]["resourceVersion"]

    def _watch(self, version: str) -> None:
        """Apply events from `version` on until the API server ends a watch with an error (raised)."""
        from kubernetes import watch  # as in _run

        from kubernetes.client.rest import ApiException  # as in _run

        while not self._stop.is_set():
            stream = watch.Watch().stream(self.list_call, *self.args, **self.selector, resource_version=version,
                                          timeout_seconds=WATCH_S, allow_watch_bookmarks=True, deserialize=False,
                                          _request_timeout=WATCH_S + 10)
            try:
                for event in stream:
                    version = self._apply(event)
                    if self._stop.is_set():
                        return
            except ApiException as err:  # refused at the watch's request: the Role may list, not watch
                if err.status != FORBIDDEN:
                    raise
                log.warning("may not watch %s (%s); listing them every %g s instead (the Role needs 'watch')",
                            self.what, err.reason, self.period_s)
                self.watching = False
                return

    def _apply(self, event: dict) -> str:
        """One watch event into the cache; the version it brings."""
        kind, obj = event["type"], event["object"]
        if kind == "BOOKMARK":
            return obj["metadata"]["resourceVersion"]
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(obj["metadata"]["name"], None)
            else:  # ADDED, MODIFIED
                self._objects[obj["metadata"]["name"]] = obj
        return obj["metadata"]["resourceVersion"]

