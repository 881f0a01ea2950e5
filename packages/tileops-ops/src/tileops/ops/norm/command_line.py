"""The norm family's shorthand flags for the ``tileops`` command.

``tileops.cli`` reads these tables and adds each flag to the subcommands that describe a call;
a flag means exactly the ``--param``/``--omit`` it stands for, and applies to this family's ops
only. Without ``--normalized-shape`` the dimensions normalized over follow from ``--shape`` as
the manifest's shape pattern of ``x`` binds them: the last one, as in the first workload.
"""

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {"--normalized-shape": "normalized_shape", "--eps": "eps"}

#: Flag -> the optional input it leaves out.
OMIT_FLAGS = {"--no-weight": "weight", "--no-bias": "bias"}
