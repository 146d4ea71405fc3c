"""The operator's API: the CRD schemas as Python data, the parsed and validated resources and the
tuner's typed inputs and outputs. Pure."""
