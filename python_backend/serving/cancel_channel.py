"""The front model's cancellations to the llm model: a datagram on a local socket, not a BLS request.

Triton does not pass a client's cancellation into composed models, so the front model tells the llm model itself
which request key to stop. It did so with a BLS request (`cancel: true`); dozens of those at once, as when a client
holding many streams goes away, crashed the front's stub inside Triton 2.51's python backend (a segfault in the BLS
call, or a corrupted heap found later: docs/operations.md). Each llm instance listens on `{instance}.cancel` in the
server's runtime folder, beside the heartbeats; the front sends the key to every live instance of the model, with no
round trip through Triton. The llm model still takes `cancel: true` requests from other clients."""

from __future__ import annotations

import queue
import socket
import threading
from pathlib import Path
from typing import Callable

from python_backend.serving.heartbeat import runtime_dir

SUFFIX = ".cancel"
MAX_KEY_BYTES = 1024
MAX_PATH_BYTES = 107  # sockaddr_un's sun_path, less its closing NUL
# A listener's queue holds only net.unix.max_dgram_qlen datagrams (10 here): a burst of cancels waits for it to read
# them. One that has not read for this long (its process stalled: the supervisor replaces it) loses the key.
SEND_TIMEOUT_S = 10.0


class CancelListener:
    """Binds `{instance}.cancel` in the folder and calls ``on_cancel(key)`` for each key received, on a thread."""

    def __init__(self, instance: str, on_cancel: Callable[[str], None], folder: Path | None = None):
        self.path = (folder or runtime_dir()) / f"{instance}{SUFFIX}"
        self.on_cancel = on_cancel
        self._stopped = threading.Event()
        self._socket: socket.socket | None = None
        self._inode: int | None = None

    def start(self) -> None:
        if len(str(self.path).encode()) > MAX_PATH_BYTES:
            print(f"[cancel-listener] {self.path} is too long for a socket ({MAX_PATH_BYTES} bytes): the front "
                  f"model's cancellations will not reach this instance; set TRITON_LLM_RUNTIME_DIR to a shorter "
                  f"folder", flush=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A socket of the same name is an earlier process's of this instance: a dead one's, or the one a reload
        # replaces (Triton starts the new instance first), which stops hearing cancels as its requests drain.
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            listener.bind(str(self.path))
        except OSError as error:
            listener.close()
            raise OSError(f"cannot listen for cancellations on {self.path}: {error}") from error
        listener.settimeout(0.25)  # how soon stop() is seen
        self._socket, self._inode = listener, self.path.stat().st_ino
        threading.Thread(target=self._listen, name="cancel-listener", daemon=True).start()

    def _listen(self) -> None:
        with self._socket as listener:
            while not self._stopped.is_set():
                try:
                    key = listener.recv(MAX_KEY_BYTES)
                except TimeoutError:
                    continue
                except OSError as error:
                    print(f"[cancel-listener] stopped: {error}", flush=True)
                    return
                try:
                    self.on_cancel(key.decode("utf-8", errors="replace"))
                except Exception as error:  # noqa: BLE001 - one bad cancel must not end the listening
                    print(f"[cancel-listener] {type(error).__name__}: {error}", flush=True)

    def stop(self) -> None:
        self._stopped.set()
        if self._socket is None:
            return
        try:  # only our own socket: a reload's new instance may have bound this name already
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except OSError:
            pass


class CancelSender:
    """``sender(key)`` queues the key and returns at once; a thread of its own then tells every instance of the model
    listening in the folder to cancel the request with that key (``send``). None listening (the model is down or
    reloading) is not an error: a model process that is gone has dropped its requests anyway."""

    def __init__(self, model: str, folder: Path | None = None, timeout_s: float = SEND_TIMEOUT_S):
        self.model, self.folder = model, folder or runtime_dir()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.settimeout(timeout_s)
        self._keys: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_queued, name="cancel-sender", daemon=True)
        self._thread.start()

    def instances(self) -> list[Path]:
        """The sockets of this model's instances (named `<model>_<group>_<index>.cancel`, as Triton names them)."""
        return sorted(path for path in self.folder.glob(f"*{SUFFIX}")
                      if path.name[:-len(SUFFIX)].rsplit("_", 2)[0] == self.model)

    def __call__(self, key: str) -> None:
        if len(key.encode("utf-8")) > MAX_KEY_BYTES:
            raise ValueError(f"a cancel key is at most {MAX_KEY_BYTES} bytes")
        self._keys.put(key)

    def send(self, key: str) -> int:
        """Sends the key now; returns how many instances it reached."""
        reached = 0
        for path in self.instances():
            try:
                self._socket.sendto(key.encode("utf-8"), str(path))
                reached += 1
            except OSError as error:  # a socket left by a dead process refuses; a stalled one's queue stays full
                if not isinstance(error, ConnectionRefusedError):
                    print(f"[cancel] could not tell {path.name} to cancel {key}: {error!r}", flush=True)
        return reached

    def _send_queued(self) -> None:
        while (key := self._keys.get()) is not None:
            self.send(key)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued (for at most timeout_s), then closes; keys queued later are dropped."""
        self._keys.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._socket.close()
