"""``vllm_plugin.updates.WeightUpdates`` when one of vLLM's calls fails, and its hold shared by two
API processes' instances (``hold_state.py``) with their lease. A real engine cannot be made to fail
on demand, so the engine here is a recording stand-in (failure injection); the procedure on real
servers: tests/test_weight_pushes.py, tests/test_weight_updates.py, tests/test_server_cli.py
(two API processes)."""

from __future__ import annotations

import asyncio
import os

import pytest

from protocol.errors import UpdateConflict
from vllm_plugin.admission import Admission
from vllm_plugin.updates import WeightUpdates


class Engine:
    """The calls ``WeightUpdates`` makes; each name in ``fail`` raises once."""

    def __init__(self, *fail: str) -> None:
        self.fail, self.calls, self.version, self.paused = set(fail), [], "v0", False

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            self.fail.discard(name)
            raise RuntimeError(f"{name} failed")

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self._call("pause")
        self.paused = True

    async def resume_generation(self) -> None:
        self._call("resume")
        self.paused = False

    async def reset_encoder_cache(self) -> None:
        self._call("reset_encoder_cache")

    async def reset_prefix_cache(self) -> bool:
        self._call("reset_prefix_cache")
        return True

    async def update_weight_version(self, version: str) -> None:
        self._call("update_weight_version")
        self.version = version


def _updates(engine: Engine) -> tuple[WeightUpdates, Admission]:
    async def versions() -> str:
        return engine.version

    admission = Admission(versions, None)
    return WeightUpdates(engine, admission, versions), admission


@pytest.mark.parametrize("failing", ["reset_encoder_cache", "reset_prefix_cache", "update_weight_version"])
def test_a_failed_reset_or_version_leaves_the_server_held_for_another_release(failing):
    async def run() -> None:
        engine = Engine(failing)
        updates, admission = _updates(engine)
        await updates.hold()
        with pytest.raises(RuntimeError, match=failing):
            await updates.release(version="v1")
        assert updates.held and not admission.is_open and engine.paused  # no old cache served
        answer = await updates.release(version="v1")
        assert answer["weight_version"] == "v1" and not updates.held and admission.is_open
        assert not engine.paused

    asyncio.run(run())


def test_a_failed_resume_still_opens_the_gate():
    async def run() -> None:
        engine = Engine("resume")
        updates, admission = _updates(engine)
        await updates.hold()
        with pytest.raises(RuntimeError, match="resume"):
            await updates.release(version="v1")
        assert admission.is_open and not updates.held and engine.version == "v1"
        await updates.hold()  # a later hold works (and pauses again)
        await updates.release(version=None)
        assert not engine.paused

    asyncio.run(run())


def test_a_failed_pause_is_undone_and_the_gate_opens():
    async def run() -> None:
        engine = Engine("pause")
        updates, admission = _updates(engine)
        with pytest.raises(RuntimeError, match="pause"):
            await updates.hold()
        assert engine.calls == ["pause", "resume"] and admission.is_open and not updates.held

    asyncio.run(run())


def test_an_update_releases_once_more_after_a_failed_reset():
    """``update`` has no hold of the caller's to release: a reset that fails once is tried again,
    and the update lands; failing twice, the server stays held (release again)."""

    async def run() -> None:
        import tempfile

        engine = Engine("reset_prefix_cache")
        engine.collective_rpc = _noop
        updates, admission = _updates(engine)
        with tempfile.TemporaryDirectory() as weights:
            answer = await updates.update(weights_path=weights, version="v1")
            assert answer["weight_version"] == "v1" and admission.is_open and not updates.held
            engine.fail = {"reset_encoder_cache"}
            engine.calls.clear()
            engine.reset_encoder_cache = _always_fails
            with pytest.raises(RuntimeError):
                await updates.update(weights_path=weights, version="v2")
            assert updates.held and not admission.is_open and engine.version == "v1"

    asyncio.run(run())


async def _noop(*args, **kwargs) -> None:
    return None


async def _always_fails() -> None:
    raise RuntimeError("reset_encoder_cache failed")


def _pair(engine: Engine, tmp_path, lease_s: float = 300.0):
    """Two API processes' ``WeightUpdates`` on one shared record (this process's pid and its
    parent's stand for the two processes: both alive), each with its own gate and watcher."""
    from vllm_plugin.hold_state import SharedHold

    async def versions() -> str:
        return engine.version

    path = tmp_path / "hold.json"
    out = []
    for pid in (os.getpid(), os.getppid()):
        admission = Admission(versions, None)
        out.append(WeightUpdates(engine, admission, versions, SharedHold(path, pid), lease_s=lease_s))
    return out


def test_a_hold_taken_on_one_process_is_released_on_the_other(tmp_path):
    """The hold is one state: the other process's gate closes (its watcher), the drain waits for
    the other process's admitted request, and a release reaching the other process ends the hold
    and opens both gates."""

    async def run() -> None:
        engine = Engine()
        first, second = _pair(engine, tmp_path)
        watchers = [asyncio.create_task(u.watch()) for u in (first, second)]
        done = asyncio.Event()

        async def request() -> None:
            async with second.admission.admit():
                await done.wait()

        running = asyncio.create_task(request())
        await asyncio.sleep(0.05)
        hold = asyncio.create_task(first.hold())
        await asyncio.sleep(0.2)
        assert not hold.done() and not second.admission.is_open  # waits for the other's request
        done.set()
        answer = await asyncio.wait_for(hold, 5)
        assert answer["drained_requests"] == 1 and engine.paused and second.held
        with pytest.raises(UpdateConflict):
            await second.hold()
        released = await second.release(version="v1")
        assert released["weight_version"] == "v1" and not first.held and not engine.paused
        await asyncio.sleep(0.1)
        assert first.admission.is_open and second.admission.is_open
        for task in (*watchers, running):
            task.cancel()

    asyncio.run(run())


def test_a_hold_past_its_lease_is_released_by_a_watcher(tmp_path):
    async def run() -> None:
        engine = Engine()
        first, second = _pair(engine, tmp_path, lease_s=0.3)
        watchers = [asyncio.create_task(u.watch()) for u in (first, second)]
        await asyncio.wait_for(first.hold(), 5)  # the other process's watcher acknowledges it
        await asyncio.sleep(0.1)
        assert first.held and engine.paused and not second.admission.is_open
        await asyncio.sleep(0.5)
        assert not first.held and not engine.paused
        assert first.admission.is_open and second.admission.is_open
        await asyncio.wait_for(first.hold(), 5)  # the server is idle: a new hold works
        await first.release(version=None)
        for task in watchers:
            task.cancel()

    asyncio.run(run())
