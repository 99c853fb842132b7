"""Whether W&B has been configured on this machine, and the CLI's offline fallback when it has not.

W&B can be configured in several places: ``WANDB_MODE`` / ``WANDB_API_KEY`` in the environment,
``wandb login`` (an API key in ``~/.netrc``, or the file ``NETRC`` names, for the W&B host),
``wandb offline`` / ``wandb disabled`` (a ``mode`` in W&B's settings files). The CLI never overrides
any of them. Only on a machine with none of them, where ``wandb.init`` would stop to ask for a key
(or fail without a terminal), and only when the run has a ``WandbLogger``, does it set ``WANDB_MODE=offline`` and
say so: runs are then written under the logger's ``save_dir`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import configparser
import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

# W&B's default server; releases from 0.31 on name it by its CoreWeave host, older ones by api.wandb.ai.
_DEFAULT_HOSTS = ("https://api.wandb.ai", "https://api.forge.coreweave.com")


def wandb_configuration() -> str | None:
    """Where this process's W&B configuration comes from (a short description), or None if it has none.

    Example::

        wandb_configuration()   # 'WANDB_MODE=offline', 'an API key in /home/me/.netrc', ... or None
    """
    if "WANDB_MODE" in os.environ:
        return f"WANDB_MODE={os.environ['WANDB_MODE']}"
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    mode, base_url = _settings()
    if mode not in (None, "online"):
        return f"W&B settings (mode = {mode})"
    base_url = base_url or os.environ.get("WANDB_BASE_URL")
    for url in [base_url] if base_url else _DEFAULT_HOSTS:
        if entry := _netrc_entry(url):
            return entry
    return None


def default_to_offline(save_dir: str | None = None) -> str | None:
    """Set ``WANDB_MODE=offline`` if W&B is not configured at all; return the message to say, else None.

    ``save_dir``: the WandbLogger's, where the offline run is written (``<save_dir>/wandb``).
    """
    if wandb_configuration() is not None:
        return None
    os.environ["WANDB_MODE"] = "offline"
    where = str(Path(save_dir or ".") / "wandb")
    return (
        "W&B is not configured here (no WANDB_API_KEY, no `wandb login`, no WANDB_MODE): logging offline "
        f"to {where}. Run `wandb login` (or set WANDB_MODE) to choose otherwise; `wandb sync {where}/offline-run-*` "
        "uploads offline runs."
    )


def _settings() -> tuple[str | None, str | None]:
    """``mode`` and ``base_url`` from W&B's settings files: the workspace's (``wandb offline`` writes
    ``./wandb/settings``) over the global one (``~/.config/wandb/settings``).

    Read as files: ``wandb.setup()`` would resolve the same, but it starts W&B's service process.
    """
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    workspace = Path(os.environ.get("WANDB_DIR") or ".") / "wandb"
    parser = configparser.ConfigParser()
    try:
        parser.read([config_dir / "settings", workspace / "settings"])
    except configparser.Error:
        return None, None
    section = parser["default"] if parser.has_section("default") else {}
    return section.get("mode"), section.get("base_url")


def _netrc_entry(base_url: str) -> str | None:
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    host = urlsplit(base_url).hostname or base_url
    try:
        found = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return f"an API key for {host} in {path}" if found and found[2] else None
