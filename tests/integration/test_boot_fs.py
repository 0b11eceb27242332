"""The start-up hook registers the plugin into every FS run on the machine, and FS_FEDPA_DISABLE=1 turns it off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.tiny_assets import fs_env

pytestmark = pytest.mark.integration

PROBE = (
    "from federatedscope.core.configs.config import global_cfg\n"
    "from federatedscope.register import trainer_dict, worker_dict\n"
    "print('fedpa' in global_cfg, 'fedpa' in worker_dict)\n"
)


@pytest.mark.parametrize("value,registered", [(None, True), ("0", True), ("1", False), ("yes", False)])
def test_fs_fedpa_disable_keeps_the_plugin_out_of_fs(value, registered):
    env = fs_env()
    env.pop("FS_FEDPA_DISABLE", None)
    if value is not None:
        env["FS_FEDPA_DISABLE"] = value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == [str(registered), str(registered)], done.stdout
