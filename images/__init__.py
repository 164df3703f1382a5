"""The appliance's container images, built locally from Debian's archive with no registry.

The API is in ``images.build`` (not re-exported here, so that ``python -m images.build`` runs
the module once): ``ensure_images()`` returns the tags of the base, infra and agent images,
building what is missing. See ``images/README.md``.
"""
