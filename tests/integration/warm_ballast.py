"""A module a warm host preloads in `test_warm_hosts`: importing it takes 64 MiB (touched)."""

BALLAST = bytearray(64 << 20)
for _i in range(0, len(BALLAST), 4096):
    BALLAST[_i] = 1
