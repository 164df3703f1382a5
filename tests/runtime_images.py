"""A tiny test image for the runtime tests, built locally (no registry is reachable).

The image is a deterministic tar: the host's static busybox (Debian package `busybox-static`),
a link per applet, /etc/passwd with the agent (1001) and nobody (65534), and the directories the
Docker provider mounts volumes on (/home/agent, /opt/tools) owned by the agent, because a new
named volume takes its owner from the image's directory. It is imported with `docker import`
and tagged by a hash of its content, so it is built once and reused while the content is the
same. The real agent and infra images live in images/ and are not needed here.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile

import docker
import docker.errors

REPOSITORY = "agent-appliance/test-busybox"
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
AGENT_UID = 1001
NOBODY_UID = 65534


def find_static_busybox() -> str | None:
    for path in BUSYBOX_CANDIDATES:
        if shutil.which(path) is not None:
            with open(path, "rb") as binary:
                head = binary.read(4096)
            # A dynamically linked busybox has a PT_INTERP naming the loader; the image has none.
            if b"/lib64/ld-linux" not in head and b"/lib/ld-linux" not in head:
                return path
    return None


def _applets(busybox: str) -> list[str]:
    import subprocess

    listed = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    return sorted({name for name in listed.stdout.split() if name and "/" not in name})


def build_tar(busybox: str) -> bytes:
    out = io.BytesIO()

    def add(
        name: str, kind: bytes, *, mode: int, uid: int = 0, data: bytes = b"", link: str = ""
    ) -> None:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = mode
        info.uid = info.gid = uid
        info.mtime = 0  # deterministic content hash
        info.linkname = link
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if data else None)

    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for directory in ("bin", "etc", "proc", "sys", "dev", "opt", "home", "run", "var"):
            add(directory, tarfile.DIRTYPE, mode=0o755)
        add("tmp", tarfile.DIRTYPE, mode=0o1777)
        add("home/agent", tarfile.DIRTYPE, mode=0o755, uid=AGENT_UID)
        add("opt/tools", tarfile.DIRTYPE, mode=0o755, uid=AGENT_UID)
        # Owned by the agent but not a volume: writing there fails only because the root is
        # read-only (a test tells EROFS from EACCES with it).
        add("srv", tarfile.DIRTYPE, mode=0o755, uid=AGENT_UID)
        with open(busybox, "rb") as binary:
            add("bin/busybox", tarfile.REGTYPE, mode=0o755, data=binary.read())
        for applet in _applets(busybox):
            if applet != "busybox":
                add(f"bin/{applet}", tarfile.SYMTYPE, mode=0o777, link="busybox")
        passwd = (
            "root:x:0:0:root:/root:/bin/sh\n"
            f"agent:x:{AGENT_UID}:{AGENT_UID}:agent:/home/agent:/bin/sh\n"
            f"nobody:x:{NOBODY_UID}:{NOBODY_UID}:nobody:/:/bin/false\n"
        )
        group = f"root:x:0:\nagent:x:{AGENT_UID}:\nnogroup:x:{NOBODY_UID}:\n"
        add("etc/passwd", tarfile.REGTYPE, mode=0o644, data=passwd.encode())
        add("etc/group", tarfile.REGTYPE, mode=0o644, data=group.encode())
    return out.getvalue()


def ensure_test_image(client: docker.DockerClient) -> str:
    """The test image's tag, imported into the engine if it is not there yet."""
    busybox = find_static_busybox()
    if busybox is None:
        raise RuntimeError("a static busybox is needed: apt-get install busybox-static")
    data = build_tar(busybox)
    tag = hashlib.sha256(data).hexdigest()[:16]
    reference = f"{REPOSITORY}:{tag}"
    try:
        client.images.get(reference)
    except docker.errors.ImageNotFound:
        client.api.import_image_from_data(data, repository=REPOSITORY, tag=tag)
        client.images.get(reference)  # raises if the import did not produce it
    return reference
