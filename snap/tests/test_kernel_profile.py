"""memfit.measure.kernel_profile on the CPU (operators stand in for kernels)."""
import torch

from memfit.measure.kernel_profile import kernel_profile


def test_profile_counts_every_call_and_orders_by_time():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        for _ in range(3):
            torch.mm(a, b)
        torch.add(a, b)

    by_name, groups, idle = kernel_profile(step, "cpu")
    assert by_name["aten::mm"]["launches"] == 3 and by_name["aten::add"]["launches"] == 1
    times = [v["ms"] for v in by_name.values()]
    assert times == sorted(times, reverse=True) and all(t >= 0 for t in times)
    assert {g["name"] for g in groups} >= {"aten::mm", "aten::add"}
    assert idle["span_ms"] > 0 and 0 <= idle["idle_ms"] <= idle["span_ms"] and idle["gaps"] >= len(idle["longest"])
