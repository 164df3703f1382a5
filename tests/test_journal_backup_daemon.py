"""The journal's lifecycle through a real applianced: prune with a signed checkpoint, a signed
export verified offline, backup while it runs, restore once it is stopped, verify."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from appliance.demo_upstream import FakeServer
from tests.daemon_support import REACH_TEST_HOSTS, Appliance

pytestmark = pytest.mark.docker


def test_backup_restore_verify_with_a_running_daemon(
    appliance: Appliance, plain_host: FakeServer, tmp_path: Path
) -> None:
    app = appliance
    app.start()
    name = app.crew("jb")
    code, created = app.ctl_json("crew", "create", name, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    for i in range(3):
        ran = app.ctl("run", name, "--", "echo", f"entry {i}")
        assert ran.returncode == 0, ran.stderr
    code, report = app.ctl_json("journal", "verify")
    assert code == 0, report
    key = report["keys"][0]
    assert (app.state_dir / "journal.key").stat().st_mode & 0o777 == 0o600

    # Backup while applianced runs and keeps journaling (a run during the copy).
    backup_file = tmp_path / "journal.backup"
    code, made = app.ctl_json("journal", "backup", str(backup_file))
    assert code == 0, made
    assert made["head_seq"] >= report["head_seq"] and made["key"] == key
    assert app.ctl("run", name, "--", "echo", "after the backup").returncode == 0
    offline = app.ctl("journal", "verify", "--file", str(backup_file), "--public-key", key)
    assert offline.returncode == 0, offline.stderr
    assert "backup intact" in offline.stdout

    # Retention on demand: everything up to the head goes behind a signed checkpoint.
    code, pruned = app.ctl_json("journal", "prune", "--keep-bytes", "1")
    assert code == 0, pruned
    assert pruned["removed"] > 0 and pruned["checkpoint_seq"] is not None
    code, after = app.ctl_json("journal", "verify")
    assert code == 0, after
    assert after["first_seq"] > 1 and after["checkpoint"]["removed_through_seq"] > 0

    # A signed export of one crew, verified offline with the key.
    assert app.ctl("run", name, "--", "echo", "exported").returncode == 0
    exported = app.ctl("journal", "export", "--jsonl", "--crew", name, "--since", "1h")
    assert exported.returncode == 0, exported.stderr
    export_file = tmp_path / "export.jsonl"
    export_file.write_text(exported.stdout)
    checked = app.ctl(
        "--json", "journal", "verify", "--file", str(export_file), "--public-key", key
    )
    assert checked.returncode == 0, checked.stdout
    result = json.loads(checked.stdout)
    assert result["ok"] and result["key_trusted"] and result["entries"] >= 2
    edited = export_file.read_text().replace("exported", "exporteD")
    export_file.write_text(edited)
    tampered = app.ctl("journal", "verify", "--file", str(export_file), "--public-key", key)
    assert tampered.returncode == 6 and "TAMPERED" in tampered.stderr

    # Restore: never under the running daemon; refuses to replace without --force.
    config = ["--config", str(app.config)]
    refused = app.ctl(*config, "journal", "restore", str(backup_file), "--force")
    assert refused.returncode == 1 and "applianced is running" in refused.stderr
    app.stop()
    refused = app.ctl(*config, "journal", "restore", str(backup_file))
    assert refused.returncode == 1 and "--force" in refused.stderr
    restored = app.ctl(*config, "--json", "journal", "restore", str(backup_file), "--force")
    assert restored.returncode == 0, restored.stderr
    done = json.loads(restored.stdout)
    assert done["head_seq"] == made["head_seq"] and Path(done["replaced"]).exists()

    app.start()
    code, final = app.ctl_json("journal", "verify")
    assert code == 0, final
    assert final["first_seq"] == 1 and final["head_seq"] >= made["head_seq"]
    assert final["anchor_seq"] >= made["head_seq"]
    time.sleep(0.1)
    assert app.ctl("run", name, "--", "echo", "after the restore").returncode == 0
    assert app.ctl_json("journal", "verify")[0] == 0
