"""The analytic model of a step (memory, traffic, time), the search over layouts, and what the compiler really did."""
