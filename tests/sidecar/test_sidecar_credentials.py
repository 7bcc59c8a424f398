"""Per-pod credentials at the sidecar: it writes its pod's credential for the vLLM container
(``--credential-file``), keeps it minted with the current cache token, and its hand-off accepts
the cache token or its own pod's credential, never another pod's. Real sidecar processes and
hand-off clients over real sockets."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sidecar_helpers import SidecarProcess, run_client

from maru_core.pod_credentials import mint, pod_of
from test_sidecar_handoff import NO_INDEX, TOKEN

POD = "test-ns/pod-a"
NEW_TOKEN = "rotated-token-9876543210"


@pytest.fixture
def token_file(sock_dir):
    path = sock_dir.parent / f"{sock_dir.name}.token"
    write_token(path, TOKEN)
    yield path
    path.unlink()


def write_token(path: Path, token: str) -> None:
    """Replace the token file whole, as a Secret volume's update does."""
    temp = path.with_name(path.name + ".new")
    temp.write_text(token + "\n")
    temp.chmod(0o600)
    os.replace(temp, path)


def env_without_pod() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("POD_NAME", "POD_NAMESPACE")}


def read_credential(path: Path) -> str:
    return path.read_text().strip()


def test_the_credential_is_written_before_the_socket_is_bound_0440_naming_its_pod(pool, sock_dir, token_file):
    sock, credential = sock_dir / "maru.sock", sock_dir / "credential"
    seen: dict[str, bool] = {}

    def watch() -> None:  # at the moment the socket appears, the credential must already be there
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.0002)
        seen["credential"] = credential.exists()

    watcher = threading.Thread(target=watch)
    watcher.start()
    group = 65534 if os.getgid() != 65534 else 0  # any group but our own shows the chown happened
    sidecar = SidecarProcess(pool.where, sock, NO_INDEX, token_file=str(token_file), credential_file=credential,
                             pod=POD)  # fmt: skip
    sidecar.cmd += ["--socket-group", str(group)]
    try:
        sidecar.start()
        watcher.join(timeout=30)
        assert seen == {"credential": True}, sidecar.log_text()
        st = os.stat(credential)
        assert stat.S_IMODE(st.st_mode) == 0o440 and st.st_gid == group and st.st_uid == os.getuid()
        assert pod_of(TOKEN, read_credential(credential)) == POD
        assert f"pod {POD}: its credential is in {credential}" in sidecar.log_text()
        assert [p.name for p in sock_dir.iterdir() if p.name.startswith(".")] == []  # no temporary file left
        labels = [key for key in sidecar.metrics() if key[0] == "maru_sidecar_handoffs_total"][0][1]
        assert ("namespace", "test-ns") in labels and ("pod", "pod-a") in labels  # --pod NAMESPACE/NAME
    finally:
        sidecar.close()


def test_a_handoff_with_the_pods_credential_succeeds_and_the_cache_token_still_does(
    pool, sock_dir, token_file, sidecars
):
    sock, credential = sock_dir / "maru.sock", sock_dir / "credential"
    sidecar = sidecars(pool.where, sock, NO_INDEX, token_file=str(token_file), credential_file=credential, pod=POD)
    answer = run_client(sock, "c1", read_credential(credential))
    assert answer["ok"], answer
    assert answer["magic"] == "MARUPOOL" and answer["uuid"] == pool.geometry.uuid
    assert run_client(sock, "c1", TOKEN)["ok"]
    assert "refused the pool" not in sidecar.log_text()


@pytest.mark.parametrize(
    "offered, message",
    [
        (mint(TOKEN, "test-ns/pod-b"), "the credential names pod 'test-ns/pod-b'; this sidecar serves pod 'test-ns/pod-a'"),
        (mint(TOKEN, "other-ns/pod-a"), "this sidecar serves pod 'test-ns/pod-a'"),
        (mint(TOKEN, POD)[:-1] + ("0" if mint(TOKEN, POD)[-1] != "0" else "1"), "not minted with the token"),
        (mint("another-cache-token-0123", POD), "not minted with the token of cache 'c1'"),
        (mint(TOKEN, POD).replace("pod-a", "pod-b"), "not minted with the token"),  # a renamed credential
    ],
    ids=["another-pod", "another-namespace", "tampered-mac", "another-cache", "renamed"],
)
def test_another_pods_or_a_forged_credential_is_refused_naming_the_pod_served(
    pool, sock_dir, token_file, sidecars, offered, message
):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(pool.where, sock, NO_INDEX, token_file=str(token_file), credential_file=sock_dir / "cred",
                       pod=POD)  # fmt: skip
    answer = run_client(sock, "c1", offered)
    assert not answer["ok"] and answer["type"] == "auth", answer
    assert message in answer["message"] and "serves pod 'test-ns/pod-a'" in answer["message"], answer
    assert message in sidecar.log_text()


def test_a_rotated_token_rewrites_the_credential_and_the_old_one_is_refused(pool, sock_dir, token_file, sidecars):
    sock, credential = sock_dir / "maru.sock", sock_dir / "credential"
    sidecars(pool.where, sock, NO_INDEX, token_file=str(token_file), credential_file=credential, pod=POD)
    old = read_credential(credential)
    write_token(token_file, NEW_TOKEN)
    # Without any hand-off: the index probe reads the token every few seconds and rewrites the file.
    deadline = time.monotonic() + 20
    while read_credential(credential) == old:
        assert time.monotonic() < deadline, "the credential was not rewritten after the token changed"
        time.sleep(0.1)
    new = read_credential(credential)
    assert pod_of(NEW_TOKEN, new) == POD and pod_of(TOKEN, new) is None
    assert stat.S_IMODE(os.stat(credential).st_mode) == 0o440
    refused = run_client(sock, "c1", old)
    assert not refused["ok"] and refused["type"] == "auth" and "not minted with the token" in refused["message"]
    assert run_client(sock, "c1", new)["ok"]

    # A hand-off reads the token too: one that comes right after a rotation rewrites the file before it is answered.
    third = "third-token-abcdefghijklmnop"
    write_token(token_file, third)
    assert run_client(sock, "c1", mint(third, POD))["ok"]
    assert read_credential(credential) == mint(third, POD)


@pytest.mark.parametrize("pod_env", [{}, {"POD_NAMESPACE": "test-ns", "POD_NAME": "pod-a"}], ids=["unknown", "env"])
def test_without_a_credential_file_a_credential_is_accepted_only_from_the_pod_the_sidecar_knows(
    pool, sock_dir, token_file, pod_env
):
    sock = sock_dir / "maru.sock"
    sidecar = SidecarProcess(pool.where, sock, NO_INDEX, token_file=str(token_file))
    sidecar.env = {**env_without_pod(), **pod_env}
    try:
        sidecar.start()
        answer = run_client(sock, "c1", mint(TOKEN, POD))
        if pod_env:  # the downward API tells the sidecar its pod
            assert answer["ok"], answer
            refused = run_client(sock, "c1", mint(TOKEN, "test-ns/pod-b"))
            assert not refused["ok"] and "serves pod 'test-ns/pod-a'" in refused["message"]
        else:
            assert not answer["ok"] and answer["type"] == "auth" and "does not know its pod" in answer["message"]
        assert run_client(sock, "c1", TOKEN)["ok"]
    finally:
        sidecar.close()


@pytest.mark.parametrize(
    "flags, pod_env, message",
    [
        (["--credential-file", "{dir}/cred"], {"POD_NAMESPACE": "ns", "POD_NAME": "p"}, "set --token-file"),
        (["--credential-file", "{dir}/cred", "--token-file", "{token}"], {}, "set --pod NAMESPACE/NAME"),
        (["--credential-file", "{dir}/cred", "--token-file", "{token}"], {"POD_NAME": "p"}, "set --pod NAMESPACE/NAME"),
        (["--credential-file", "{dir}/cred", "--token-file", "{token}", "--pod", "ns/bad name"], {},
         "--pod: pod identity 'ns/bad name' is not NAMESPACE/NAME"),
        (["--credential-file", "{dir}/cred", "--token-file", "{token}"], {"POD_NAMESPACE": "ns", "POD_NAME": "-p"},
         "--credential-file needs a valid pod identity (--pod or $POD_NAMESPACE/$POD_NAME)"),
        (["--credential-file", "{dir}/none/cred", "--token-file", "{token}", "--pod", POD], {},
         "--credential-file {dir}/none/cred: directory {dir}/none does not exist"),
        (["--credential-file", "{token}", "--token-file", "{token}", "--pod", POD], {},
         "is the --token-file: the token would be overwritten"),
        (["--pod", "ns/p", "--namespace", "other"], {}, "--pod ns/p and --namespace other name two namespaces"),
    ],
    ids=["no-token-file", "no-pod", "no-namespace", "bad-pod-flag", "bad-pod-env", "no-directory", "token-file",
         "two-namespaces"],
)
def test_credential_settings_that_cannot_work_stop_the_start_naming_the_flag(
    sock_dir, token_file, flags, pod_env, message
):
    def fill(text: str) -> str:
        return text.format(dir=sock_dir, token=token_file)

    out = subprocess.run(
        [sys.executable, "-m", "maru_core.cli", "sidecar", "--pool", "/dev/shm/none", "--socket",
         str(sock_dir / "s.sock"), "--index", NO_INDEX, *map(fill, flags)],
        capture_output=True, text=True, timeout=30, env={**env_without_pod(), **pod_env},
    )  # fmt: skip
    assert out.returncode == 2 and fill(message) in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert read_token_unchanged(token_file) and not (sock_dir / "s.sock").exists()


def read_token_unchanged(token_file: Path) -> bool:
    return token_file.read_text().strip() == TOKEN


def test_a_reader_sees_the_old_credential_or_the_new_one_never_a_part(sock_dir):
    from maru_sidecar.credential_file import CredentialFile

    path = sock_dir / "credential"
    credential = CredentialFile(path, POD)
    tokens = [f"token-number-{i:012d}" for i in range(200)]
    credential.write(tokens[0])
    whole = {mint(token, POD) for token in tokens}
    stop, torn = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            text = read_credential(path)
            if text not in whole:
                torn.append(text)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for token in tokens[1:]:
            credential.refresh(token)
    finally:
        stop.set()
        reader.join()
    assert torn == [] and read_credential(path) == mint(tokens[-1], POD)
    assert sorted(p.name for p in sock_dir.iterdir()) == ["credential"]
