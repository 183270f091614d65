"""Protocol buffer contracts (``*.proto``) and their generated Python stubs."""


def step_path_names() -> dict[int, str]:
    """The data plane's step paths other than eager, by the name of their ServerStats counters:
    STEP_PATH_DECODE_GRAPH -> "decode_graph" (``decode_graph_steps``, ``decode_graph_execute_us``)."""
    from twinplane.proto import dataplane_pb2 as dp

    return {value: name.removeprefix("STEP_PATH_").lower() for name, value in dp.StepPath.items()
            if value != dp.STEP_PATH_EAGER}


def set_fields(message) -> dict:
    """A message's fields that are set (an optional one: present), by name."""
    return {field.name: value for field, value in message.ListFields()}
