"""The command line against a real S3 endpoint (``moto_server`` over HTTP).

A training job's checkpoints uploaded to S3 with CRC64NVME full-object
checksums are scanned, verified without downloading a byte, tiered into an
S3 archive and drilled back from it; bad S3 input fails with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptier.flows.cli import main
from ckptier.tasks.demo import train_demo_run
from tests.fixtures.s3 import S3Server
from tests.fixtures.services import free_port

pytestmark = pytest.mark.s3


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def uploaded(s3_env: str, s3_bucket, s3_server: S3Server, tmp_path: Path,  # type: ignore[no-untyped-def]
             monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A demo run trained locally and uploaded under s3://bucket/runs/ with CRC64NVME checksums.

    Its metadata.json lists sizes but no sha256 (as many trainers write it), so
    S3's stored checksums are all there is to compare against.
    """
    run_ = train_demo_run(tmp_path / "local", steps=150, every=25)
    for path in sorted(run_.job_dir.rglob("*")):
        if path.is_file():
            key = "runs/" + path.relative_to(tmp_path / "local").as_posix()
            body = path.read_bytes()
            if path.name == "metadata.json":
                meta = json.loads(body)
                meta["files"] = {rel: {"size": f["size"]} for rel, f in meta["files"].items()}
                body = json.dumps(meta).encode()
            s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=body, ChecksumAlgorithm="CRC64NVME")
    s3_bucket.client.create_bucket(Bucket=s3_bucket.name + "-cold")
    config = tmp_path / "ckptier.toml"
    config.write_text(
        f'[[policy]]\njobs = "*"\nkeep_last = 2\nmilestones = [50, 100]\narchive = "s3://{s3_bucket.name}-cold/archive"\n'
        '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 3\n'
    )
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))  # no profile's API either
    return {"bucket": s3_bucket.name, "client": s3_bucket.client, "server": s3_server}


def test_s3_scan_verify_without_download_tier_and_drill(uploaded: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    bucket = uploaded["bucket"]
    code, out, err = run(capsys, "scan", f"s3://{bucket}/runs", "--json")
    assert code == 0, err
    (report,) = json.loads(out)
    assert report["checkpoints"] == 6 and report["incomplete"] == 1 and report["jobs"] == ["demo-run"]
    code, out, _ = run(capsys, "scan", f"s3://{bucket}/runs/", "--json")
    assert json.loads(out)[0]["rows_written"] == 0

    code, out, err = run(capsys, "verify", "--json")
    totals = json.loads(out)["totals"]
    assert code == 0, err
    # torch files and manifests are read once, for their structure (a checksum proves only what was uploaded) ...
    assert totals["verified"] == 5 and totals["bytes_read"] > 0

    code, out, err = run(capsys, "verify", "--deep", "--json")
    totals = json.loads(out)["totals"]
    assert code == 0 and totals["verified"] == 5 and totals["bytes_read"] > 0 and totals["bytes_skipped"] == 0

    # An object replaced after verification (same size, other bytes) is caught on the next scan + verify.
    client = uploaded["client"]
    key = "runs/demo-run/step-00000075/rank-0000/model.pt"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())  # type: ignore[attr-defined]
    body[-100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body), ChecksumAlgorithm="CRC64NVME")  # type: ignore[attr-defined]
    assert run(capsys, "scan", f"s3://{bucket}/runs")[0] == 0
    code, out, _ = run(capsys, "verify", "--json")
    report = json.loads(out)
    assert code == 1 and [r["step"] for r in report["checkpoints"] if r["state"] == "corrupt"] == [75]
    server = uploaded["server"]
    assert isinstance(server, S3Server)
    if server.capabilities.stored_checksums:
        assert report["totals"]["bytes_read"] == 0  # ... later checks use S3's stored checksum alone
    else:  # ... or, where the server keeps none, read the objects that changed again
        assert report["totals"]["bytes_read"] > 0

    code, out, err = run(capsys, "apply")
    assert code == 0, out + err
    code, out, _ = run(capsys, "ls", "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    # keep_last 2 counts verified ones (75 is corrupt now): 100 and 125 stay hot;
    # milestone 50 lives on in the archive only, 100 in both; 75 is kept as evidence.
    assert rows[50]["tiers"] == ["archive"] and rows[100]["tiers"] == ["hot", "archive"]
    assert rows[75]["state"] == "corrupt" and rows[75]["tiers"] == ["hot"]
    assert sorted(rows) == [50, 75, 100, 125, 150]
    listed = client.list_objects_v2(Bucket=bucket, Prefix="runs/demo-run/")  # type: ignore[attr-defined]
    left = sorted({o["Key"].split("/")[2] for o in listed.get("Contents", [])})
    assert left == ["step-00000075", "step-00000100", "step-00000125", "step-00000150"]

    code, out, err = run(capsys, "drill", "--job", "demo-run", "--step", "50", "--json")
    (drill,) = json.loads(out)
    assert code == 0, err
    assert drill["ok"] and drill["tier"] == "archive"


@pytest.mark.parametrize(
    ("url", "env", "needle"),
    [
        ("s3://no-such-bucket-ckptier/x", {}, "does not exist"),
        ("s3://{bucket}/x", {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_PROFILE": None}, "AWS_"),
        ("s3://{bucket}/x", {"AWS_ENDPOINT_URL": "http://127.0.0.1:{port}"}, "AWS_ENDPOINT_URL"),
    ],
    ids=["missing-bucket", "no-credentials", "unreachable-endpoint"],
)
def test_bad_s3_input_is_one_line(s3_env: str, s3_bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                  capsys: pytest.CaptureFixture[str], url: str, env: dict[str, str | None], needle: str) -> None:
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value.format(port=free_port()))
    if "AWS_ACCESS_KEY_ID" in env:
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, out, err = run(capsys, "scan", url.format(bucket=s3_bucket.name))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err
    code, out, _ = run(capsys, "ls", "--json")
    assert json.loads(out) == []  # nothing half-written
