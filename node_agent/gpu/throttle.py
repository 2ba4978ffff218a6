"""Which of NVML's clock-event (throttle) reasons are abnormal for a GPU.

``sw_power_cap`` and the other software reasons are how a GPU keeps to its limits under a
full load; these three mean the hardware slowed the GPU down (NVML
``nvmlClocksEventReasonHwSlowdown``, ``...HwThermalSlowdown``, ``...HwPowerBrakeSlowdown``).
"""

from __future__ import annotations

ABNORMAL_THROTTLE = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
