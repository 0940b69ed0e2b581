"""The operator console at the admin listener's `/ui/` (docs/console.md): runs, holds, live
violations, contracts and replay, in a browser, under the admin API's rules. `console_app`
builds it; the admin app mounts it with one `add_subapp`."""

from stepguard.proxy.ops.console.views import console_app

__all__ = ["console_app"]
