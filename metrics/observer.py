"""The observer: turns verdicts and upstream calls into log lines (and, later, metrics).
It is called after a decision is stored and acted on; it never decides anything."""

from __future__ import annotations

from typing import Any

from stepguard.contracts.model import Contract
from stepguard.metrics.logs import get_logger


class Observer:
    def __init__(self) -> None:
        self.log = get_logger("stepguard")

    def verdict(self, contract: Contract, run_id: str, event: dict[str, Any],
                added_s: float) -> None:
        violation = event.get("violation") or {}
        level = "warning" if violation or event.get("action") == "refuse" else "info"
        getattr(self.log, level)(
            "boundary", run_id=run_id, workflow=contract.workflow,
            contract_version=contract.version, step=event.get("step"),
            boundary=event.get("boundary"), seq=event.get("seq"), verdict=event.get("verdict"),
            check=violation.get("check"), drift=violation.get("drift"),
            action=event.get("action"), detail=violation.get("detail"),
            decision_id=event.get("decision_id"), attempt=event.get("attempt"),
            added_ms=round(added_s * 1000, 3))

    def upstream(self, upstream: str, workflow: str, status: int | None, seconds: float) -> None:
        pass

    def escalation(self, record: dict[str, Any], delivered: bool | None, detail: str = "") -> None:
        self.log.error("escalation", run_id=record.get("run_id"), workflow=record.get("workflow"),
                       step=record.get("step"), detection_point=record.get("detection_point"),
                       decision_id=record.get("decision_id"), webhook_delivered=delivered,
                       webhook_error=detail or None)

    def store_error(self, contract: Contract, detail: str) -> None:
        self.log.error("store_error", workflow=contract.workflow, detail=detail)

    def fail_open(self, contract: Contract, step: str) -> None:
        self.log.warning("fail_open", workflow=contract.workflow, step=step)
