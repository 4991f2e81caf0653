"""The analytic model of a step (memory, traffic, time), the search over layouts, and what the compiler really did.

model, layout: what is trained and how it is laid out; memory, activations, traffic, ticks, step_time:
the analytic model by concern; estimate: all of it for one layout; search: the ranking of layouts;
devices: accelerator specs; mfu: a run's MFU; inspect: the compiled step read back; compare: the two
side by side; command, pictures: `jaxpar plan`.
"""
