"""What dflash-ipc needs to know about the machine and the libraries under it: devices and dtypes by name and a
device's memory (``devices``), the host memory a run can take under its cgroup limits (``host_memory``),
row-wise e4m3 and whether a device runs FP8 GEMMs (``e4m3``), and the import notes of third-party libraries nobody
can act on, dropped (``third_party_logs``).

A leaf package: it imports nothing else of dflash-ipc.
"""
