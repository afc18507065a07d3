"""Regenerate expert_host_pb2.py and expert_host_pb2_grpc.py from expert_host.proto.

The generated modules are committed; run `python -m moeless.expert_fn.wire.gen_proto` after editing
the .proto. The proto is compiled from a temporary `moeless/expert_fn/wire/` tree so that the
generated gRPC module imports its messages as `moeless.expert_fn.wire.expert_host_pb2`. protoc runs in
a process of its own: its native library and nixl's (nixl_link.py) bundle different abseil and
protobuf builds, and one process that loads both crashes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "expert_host.proto"
GENERATED = ("expert_host_pb2.py", "expert_host_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile expert_host.proto into out_dir; returns the generated files."""
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp, "moeless", "expert_fn", "wire")
        package.mkdir(parents=True)
        shutil.copy(HERE / PROTO, package / PROTO)
        args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                f"moeless/expert_fn/wire/{PROTO}"]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed on {HERE / PROTO}: {done.stderr.strip()}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(package / name, out_dir / name)) for name in GENERATED]


if __name__ == "__main__":
    for path in generate(HERE):
        print(f"wrote {path}")
