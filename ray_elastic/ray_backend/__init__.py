"""The controller's backend on a Ray cluster: slices reserved as placement groups, the slice and
standby actors, the hosts' snapshot keepers, world formation and the step streams. It carries
out what :mod:`ray_elastic.control` decides, through the :class:`~ray_elastic.control.backend.Backend`
seam; nothing in ``control`` imports it."""
