# TEMPORARY SHIM until the op split lands
class KernelTuner:
    def __init__(self):
        self.choices, self.timings, self.step_timings = {}, {}, {}

    def near_ties(self, device, rows):
        return {}
