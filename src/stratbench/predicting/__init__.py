"""Before training: the memory estimate, the time projection to other hardware, hardware profiles, the method advice."""
