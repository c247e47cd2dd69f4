"""ipywidgets explorers: sliders feed an analytical model, the model feeds a plot function.

Each explorer renders its figure into an ``ipywidgets.Image``: moving a slider replaces the picture in place,
and executing the notebook headless (nbval, nbclient) stores no figure outputs that would differ run to run.
Every explorer is wired by ``connect``: sliders redraw when released, and the figure always shows what the
controls show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import ipywidgets as widgets

from labkit import lr
from labkit.costmodel import collectives, compute, hardware, memory, shapes, tensor_parallel
from labkit.costmodel import step as step_model
from labkit.viz import plots, tensor_plots, training_plots

SLIDERS = (widgets.IntSlider, widgets.FloatSlider, widgets.FloatLogSlider, widgets.IntRangeSlider,
           widgets.FloatRangeSlider, widgets.SelectionSlider, widgets.SelectionRangeSlider)
SLIDER_TRACK_PX = 220  # a slider's track, beside its description (connect)
SLIDER_READOUT_PX = 80  # the value printed after the track, and the margins


def connect(controls: Sequence[widgets.Widget], draw: Callable[[], None]) -> None:
    """Redraw with ``draw`` (which reads every control's current value itself) whenever a control changes.

    - Sliders update on release (``continuous_update=False``): a drag is one redraw, not one per value passed,
      which on a busy kernel queued seconds of stale figures behind the hand.
    - The last state wins: a change that arrives while a redraw runs (e.g. the redraw clamps another slider)
      makes that redraw run once more, instead of nesting a second one whose newer figure the first would
      then overwrite with an older one.
    - Descriptions are as wide as the longest (so nothing is cut to "…" and the sliders line up), and so is
      each dropdown's longest option.  A slider's width holds its description too (ipywidgets gives the whole
      slider 300 px), so each slider is widened by its description: its track keeps :data:`SLIDER_TRACK_PX` (a
      long description otherwise left the track 15-20 px wide, and one drag jumped across most of the range).
    """
    state = {"drawing": False, "stale": False}
    labels = [len(control.description) for control in controls if not isinstance(control, widgets.Checkbox)]
    description_width = max(labels, default=0) + 1  # in ch, about one character each

    def redraw(_change=None) -> None:
        state["stale"] = True
        if state["drawing"]:
            return
        state["drawing"] = True
        try:
            while state["stale"]:
                state["stale"] = False
                draw()
        finally:
            state["drawing"] = False

    for control in controls:
        if "continuous_update" in control.keys:
            control.continuous_update = False
        control.style.description_width = f"{description_width}ch"
        if isinstance(control, widgets.Dropdown):  # the layout's width holds the description too
            longest = max(len(str(label)) for label in control._options_labels)
            control.layout.width = f"{description_width + longest + 7}ch"  # + the arrow and padding
        elif isinstance(control, SLIDERS) and control.layout.width is None:
            control.layout.width = f"calc({description_width}ch + {SLIDER_TRACK_PX + SLIDER_READOUT_PX}px)"
        control.observe(redraw, names="value")
    redraw()


ROW = {"flex_flow": "row wrap"}  # the layout of a row of controls: side by side, wrapping when the notebook is narrow


def why_distributed_explorer(parameters: float = 7e9, tokens: float = 2e12, gpus: int = 64,
                             gpu: str = "H100 80GB", utilization: float = 0.4) -> widgets.VBox:
    """Model size, tokens, GPUs, GPU type and MFU -> memory per GPU and training days (lesson 00)."""
    parameter_slider = widgets.FloatLogSlider(value=parameters, base=10, min=8, max=12, step=0.05,
                                              description="parameters", readout_format=".2g")
    token_slider = widgets.FloatLogSlider(value=tokens, base=10, min=9, max=13.5, step=0.05,
                                          description="tokens", readout_format=".2g")
    gpu_slider = widgets.IntSlider(value=gpus, min=1, max=4096, description="GPUs")
    gpu_choice = widgets.Dropdown(options=list(compute.GPUS), value=gpu, description="GPU")
    mfu_slider = widgets.FloatSlider(value=utilization, min=0.1, max=0.7, step=0.05, description="MFU")
    picture = widgets.Image(format="png")

    def redraw() -> None:
        figure = plots.plot_why_distributed(parameter_slider.value, token_slider.value, gpu_slider.value,
                                            compute.GPUS[gpu_choice.value], mfu_slider.value)
        picture.value = plots.figure_to_png(figure)

    connect((parameter_slider, token_slider, gpu_slider, gpu_choice, mfu_slider), redraw)
    controls = widgets.HBox([widgets.VBox([parameter_slider, token_slider, gpu_slider]),
                             widgets.VBox([gpu_choice, mfu_slider])], layout=ROW)
    return widgets.VBox([controls, picture])


def ring_all_reduce_explorer(records: dict[tuple[int, int], list[dict]]) -> widgets.VBox:
    """Step through ring all-reduces that really ran: ``records[(world_size, segments)]`` holds every rank's
    recorded sends for that run.  Sliders pick N, the segments per chunk and the step."""
    if not records:
        raise ValueError("records is empty: record at least one run of ring_all_reduce")
    world_sizes = sorted({world_size for world_size, _ in records})
    world_choice = widgets.Dropdown(options=world_sizes, value=world_sizes[-1], description="ranks N")
    segment_slider = widgets.IntSlider(min=1, max=max(s for _, s in records), value=1, description="segments")
    step_slider = widgets.IntSlider(min=0, max=2 * (world_sizes[-1] - 1), value=0, description="step")
    picture = widgets.Image(format="png")
    caption = widgets.HTML()

    def redraw() -> None:
        world_size = world_choice.value
        available = sorted(s for n, s in records if n == world_size)
        segments = min(available, key=lambda s: abs(s - segment_slider.value))
        step_slider.max = 2 * (world_size - 1)
        states, sends = plots.ring_states(records[(world_size, segments)], world_size)
        figure = plots.plot_ring_step(states, sends, world_size, min(step_slider.value, step_slider.max))
        picture.value = plots.figure_to_png(figure)
        caption.value = (f"<small>recorded run: {world_size} ranks, each chunk cut into {segments} segment(s); "
                         f"{len(records[(world_size, segments)])} messages in all</small>")

    connect((world_choice, segment_slider, step_slider), redraw)
    return widgets.VBox([widgets.HBox([world_choice, segment_slider, step_slider], layout=ROW), caption, picture])


def alpha_beta_explorer(links: dict, world_size: int = 8) -> widgets.VBox:
    """Pick a link (alpha, beta) and a number of ranks: predicted all-reduce bus bandwidth against message size
    for the ring, the parameter server and the binomial tree (``links``: name -> ``collectives.LinkModel``)."""

    link_choice = widgets.Dropdown(options=list(links), description="link")
    rank_slider = widgets.IntSlider(value=world_size, min=2, max=64, description="ranks N")
    picture = widgets.Image(format="png")

    def redraw() -> None:
        link = links[link_choice.value]
        n = rank_slider.value
        sizes = [4 ** k for k in range(3, 15)]  # 64 B .. 256 MiB
        costs = {"ring": collectives.ring_all_reduce_cost, "parameter server": collectives.naive_all_reduce_cost,
                 "binomial tree": collectives.tree_all_reduce_cost}
        predicted = {f"{name} (model), N={n}": [collectives.bus_bandwidth(size, cost(size, n, link).time_s, n)
                                                for size in sizes]
                     for name, cost in costs.items()}
        predicted["link bandwidth 1/beta"] = [link.bandwidth_bytes_per_s] * len(sizes)
        figure = plots.plot_bandwidth(sizes, {}, predicted,
                                      title=f"{link_choice.value}: alpha = {link.alpha_s * 1e6:.1f} us, "
                                            f"1/beta = {link.bandwidth_bytes_per_s / 1e9:.1f} GB/s")
        picture.value = plots.figure_to_png(figure)

    connect((link_choice, rank_slider), redraw)
    return widgets.VBox([widgets.HBox([link_choice, rank_slider], layout=ROW), picture])


def ddp_step_explorer(links: dict, compute_ms: float = 60.0, parameters_m: float = 10.0) -> widgets.VBox:
    """Data parallelism's step-time model: model size, ranks, link, buckets, overlap -> step breakdown and
    scaling efficiency (``links``: name -> ``collectives.LinkModel``).  Compute is split 1 : 2 : 0.2 between
    forward, backward and optimizer, per rank, at a fixed per-rank batch."""

    parameter_slider = widgets.FloatLogSlider(value=parameters_m, base=10, min=-1, max=4, step=0.05,
                                              description="params (M)", readout_format=".3g")
    compute_slider = widgets.FloatLogSlider(value=compute_ms, base=10, min=0, max=4, step=0.05,
                                            description="compute (ms)", readout_format=".3g")
    rank_slider = widgets.IntSlider(value=8, min=2, max=1024, description="ranks N")
    bucket_slider = widgets.FloatLogSlider(value=25, base=10, min=-1, max=3, step=0.1, description="bucket (MiB)",
                                           readout_format=".2g")
    link_choice = widgets.Dropdown(options=list(links), description="link")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        link = links[link_choice.value]
        gradient_bytes = int(parameter_slider.value * 1e6) * 4
        cap = max(1, int(bucket_slider.value * 2**20))
        buckets = [cap] * (gradient_bytes // cap) + ([gradient_bytes % cap] if gradient_bytes % cap else [])
        total = compute_slider.value / 1e3
        forward, backward, optimizer = total / 3.2, 2 * total / 3.2, 0.2 * total / 3.2
        steps = {"1 rank (no communication)": step_model.ddp_step_time(forward, backward, optimizer, buckets, 1, link)}
        for overlap in (False, True):
            label = f"N={rank_slider.value}, overlap {'on' if overlap else 'off'}"
            steps[label] = step_model.ddp_step_time(forward, backward, optimizer, buckets, rank_slider.value, link,
                                                   overlap=overlap)
        single = steps["1 rank (no communication)"].step_s
        efficiency = {label: single / step.step_s for label, step in steps.items()}
        summary.value = "<small>" + "; ".join(f"{label}: {100 * value:.0f}% scaling efficiency"
                                              for label, value in list(efficiency.items())[1:]) + \
            f"; {len(buckets)} bucket(s) of gradients, {gradient_bytes / 1e6:,.0f} MB per step</small>"
        picture.value = plots.figure_to_png(plots.plot_step_breakdown(steps))

    connect((parameter_slider, compute_slider, rank_slider, bucket_slider, link_choice), redraw)
    controls = widgets.HBox([widgets.VBox([parameter_slider, compute_slider, rank_slider]),
                             widgets.VBox([bucket_slider, link_choice])], layout=ROW)
    return widgets.VBox([controls, summary, picture])


def lr_schedule_explorer(base_lr: float = 0.01, base_batch: int = 16, total_samples: int = 65536) -> widgets.VBox:
    """Base LR, batch multiples, warmup length and decay shape -> the scaled schedules, against steps and
    against samples seen (lesson 03)."""

    lr_slider = widgets.FloatLogSlider(value=base_lr, base=10, min=-4, max=0, step=0.1, description="base LR")
    multiples = widgets.SelectMultiple(options=[1, 2, 4, 8, 16, 32, 64, 128], value=(1, 4, 16, 64),
                                       description="batch x", rows=8)
    rule_choice = widgets.Dropdown(options=["linear", "sqrt", "none"], value="linear", description="rule")
    warmup_slider = widgets.FloatSlider(value=0.2, min=0.0, max=0.9, step=0.05, description="warmup frac")
    start_slider = widgets.FloatSlider(value=0.1, min=0.0, max=1.0, step=0.05, description="start factor")
    decay_choice = widgets.Dropdown(options=["constant", "cosine", "linear", "step"], value="cosine",
                                    description="decay")
    picture = widgets.Image(format="png")

    def redraw() -> None:
        curves, samples_per_step = {}, {}
        for k in multiples.value:
            global_batch = base_batch * k
            total = max(1, total_samples // global_batch)
            warmup = min(int(warmup_slider.value * total), total - 1)
            peak = lr.scaled_lr(lr_slider.value, base_batch, global_batch, rule=rule_choice.value)
            step_size = max(1, (total - warmup) // 3)
            label = f"batch {global_batch} ({k}x)"
            curves[label] = [peak * lr.lr_factor(step, total, warmup, start_slider.value, decay_choice.value,
                                                         step_size=step_size)
                             for step in range(total)]
            samples_per_step[label] = global_batch
        if curves:
            picture.value = plots.figure_to_png(training_plots.plot_lr_schedules(
                curves, samples_per_step, title=f"{rule_choice.value} rule, {decay_choice.value} decay"))

    connect((lr_slider, multiples, rule_choice, warmup_slider, start_slider, decay_choice), redraw)
    controls = widgets.HBox([widgets.VBox([lr_slider, rule_choice, decay_choice]),
                             widgets.VBox([warmup_slider, start_slider]), multiples], layout=ROW)
    return widgets.VBox([controls, picture])


def precision_memory_explorer(parameters_b: float = 7.0) -> widgets.VBox:
    """Model size, precision and optimizer -> model-state memory per GPU against a GPU's memory (lesson 04)."""

    size_slider = widgets.FloatLogSlider(value=parameters_b, base=10, min=-1, max=3, step=0.05,
                                         description="params (B)", readout_format=".3g")
    gpu_choice = widgets.Dropdown(options=list(compute.GPUS), value="H100 80GB", description="GPU")
    picture = widgets.Image(format="png")

    def redraw() -> None:
        count = int(size_slider.value * 1e9)
        configurations = {f"{precision}\n{optimizer}": memory.predicted_model_state_bytes(count, precision, optimizer)
                          for precision in ("fp32", "mixed") for optimizer in ("sgd", "momentum", "adam")}
        gpu = compute.GPUS[gpu_choice.value]
        figure = training_plots.plot_memory_breakdown(configurations, capacity_bytes=gpu.memory_bytes, unit=1e9,
                                             unit_name="GB", title=f"{size_slider.value:.3g}B parameters: "
                                             "model states, before any activation")
        picture.value = plots.figure_to_png(figure)

    connect((size_slider, gpu_choice), redraw)
    return widgets.VBox([widgets.HBox([size_slider, gpu_choice], layout=ROW), picture])


def memory_explorer(preset: str = "llama-2-7b") -> widgets.VBox:
    """The memory model per rank: a model preset (or size), precision, ZeRO stage, data-parallel degree,
    micro-batch, sequence length and activation checkpointing -> stacked bytes per rank against a GPU; the
    chosen stage's bar is the one drawn solid and totalled."""

    preset_choice = widgets.Dropdown(options=list(shapes.MODEL_SHAPES), value=preset, description="model")
    precision_choice = widgets.Dropdown(options=["mixed", "fp32"], value="mixed", description="precision")
    stage_slider = widgets.IntSlider(value=0, min=0, max=3, description="ZeRO stage")
    dp_slider = widgets.IntSlider(value=8, min=1, max=1024, description="DP degree")
    batch_slider = widgets.IntSlider(value=1, min=1, max=64, description="micro-batch")
    sequence_slider = widgets.IntSlider(value=4096, min=128, max=32768, step=128, description="sequence")
    checkpoint_box = widgets.Checkbox(value=False, description="activation checkpointing")
    gpu_choice = widgets.Dropdown(options=list(compute.GPUS), value="H100 80GB", description="GPU")
    picture = widgets.Image(format="png")
    verdict = widgets.HTML()

    def redraw() -> None:
        shape = dataclasses.replace(shapes.MODEL_SHAPES[preset_choice.value], seq_len=sequence_slider.value)
        count = shapes.num_parameters(shape)
        activations = memory.activation_bytes(shape, batch_slider.value, precision=precision_choice.value,
                                              flash_attention=True, checkpointing=checkpoint_box.value)
        gpu = compute.GPUS[gpu_choice.value]
        per_stage = {f"ZeRO-{stage}" if stage else "DP": memory.memory_per_rank(
            count, precision_choice.value, "adam", zero_stage=stage, dp_degree=dp_slider.value,
            activation_bytes=activations) for stage in range(4)}
        chosen_label = f"ZeRO-{stage_slider.value}" if stage_slider.value else "DP"
        chosen = per_stage[chosen_label]
        fits = chosen["total"] <= gpu.memory_bytes
        verdict.value = (f"<b>{'fits' if fits else 'does not fit'}</b>: {chosen['total'] / 1e9:,.1f} GB per rank "
                         f"against {gpu.memory_bytes / 1e9:.0f} GB ({count / 1e9:.2f}B parameters, activations "
                         f"{activations / 1e9:,.1f} GB)")
        bars = {label: {key: value for key, value in parts.items() if key != "total"}
                for label, parts in per_stage.items()}
        picture.value = plots.figure_to_png(training_plots.plot_memory_breakdown(
            bars, capacity_bytes=gpu.memory_bytes, unit=1e9, unit_name="GB", highlight=chosen_label,
            title=f"{preset_choice.value}, {precision_choice.value} precision, DP degree {dp_slider.value}: "
                  f"{chosen_label} chosen"))

    controls = (preset_choice, precision_choice, stage_slider, dp_slider, batch_slider, sequence_slider,
                checkpoint_box, gpu_choice)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), verdict, picture])


# One GPU's links, per direction (labkit.costmodel.hardware: the one source of the course's link constants).
GPU_LINKS = {"NVLink 4 (inside a node)": hardware.NVLINK.model(),
             "InfiniBand NDR (across nodes)": hardware.INFINIBAND.model()}


HEAD_DIM = 128  # the explorer's head size: GPT-3's and Llama 2's (12288 / 96, 4096 / 32, 8192 / 64)
KV_HEADS = {"one per query head (multi-head)": None, "8, shared by groups of query heads (GQA)": 8}


def tensor_parallel_explorer(hidden_size: int = 8192, seq_len: int = 4096, micro_batch: int = 1,
                             tp_degree: int = 8, gpu: str = "H100 80GB", links: dict | None = None,
                             node_size: int = 8, kv_heads: int | None = None) -> widgets.VBox:
    """Tensor parallelism per layer on GPUs (lesson 06): the degree ``t``, hidden size, sequence length,
    micro-batch, key/value heads, GPU and link -> one layer's compute (``layer_training_flops / t`` at the GPU's
    dense bf16 peak) against its communication (two all-reduces of ``b s h`` bf16 values forward, two backward,
    on a ring over the link, none overlapped), for every valid ``t`` up to 64
    (``tensor_parallel.tensor_parallel_layer_time``).  It shows why tensor parallelism stays inside a node: the
    compute falls as ``1/t``, the communication does not fall at all, and across InfiniBand it is most of the
    layer's time.

    **Only degrees that split whole heads.**  The layer has ``h / 128`` heads (:data:`HEAD_DIM`, as GPT-3 and
    Llama 2), and ``t`` must divide them and ``h``; with grouped-query attention (``kv_heads=8``, Llama-2-70B's 8
    key/value heads) it must divide the key/value heads too, as Megatron-LM requires
    (``tensor_parallel.tensor_parallel_size_problem``).  A ``t`` that does not is refused: the slider moves to
    the nearest degree that is valid, and the caption says why.  The curves are drawn at the valid degrees.

    ``links``: name -> ``collectives.LinkModel``, default :data:`GPU_LINKS`, per GPU and per direction: NVLink 4
    on an H100 SXM to the other GPUs of an 8-GPU node through NVSwitch, and InfiniBand NDR, one ConnectX-7 port
    per GPU in a DGX H100 (bandwidths and latencies from ``labkit.costmodel.hardware``, which cites the NVIDIA
    datasheets and NCCL's tuning model).  Every link but the last reaches only the ``node_size`` GPUs of one
    node, so a larger group's ring crosses the last link and is as slow as it is: past ``node_size`` the others
    are costed as the last one.
    """
    links = dict(GPU_LINKS if links is None else links)
    across = list(links)[-1]
    kv_label = next(label for label, value in KV_HEADS.items() if value == kv_heads)
    degree_slider = widgets.IntSlider(value=tp_degree, min=1, max=64, description="TP degree t")
    hidden_slider = widgets.IntSlider(value=hidden_size, min=512, max=16384, step=256, description="hidden h")
    sequence_slider = widgets.IntSlider(value=seq_len, min=128, max=32768, step=128, description="sequence s")
    batch_slider = widgets.IntSlider(value=micro_batch, min=1, max=16, description="micro-batch b")
    kv_choice = widgets.Dropdown(options=list(KV_HEADS), value=kv_label, description="key/value heads")
    gpu_choice = widgets.Dropdown(options=list(compute.GPUS), value=gpu, description="GPU")
    link_choice = widgets.Dropdown(options=list(links), description="link")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()
    refused = {"degree": None, "text": ""}  # a refused t, said in the caption of the redraw at the valid one

    def redraw() -> None:
        b, s, h, t = batch_slider.value, sequence_slider.value, hidden_slider.value, degree_slider.value
        heads, kv = h // HEAD_DIM, KV_HEADS[kv_choice.value]
        notes = []
        kv_line = f"{heads} heads of {HEAD_DIM}, " + (f"sharing {kv} key/value heads (GQA)" if kv else
                                                          "one key/value head each")
        if kv is not None and heads % kv:
            notes.append(f"{heads} query heads cannot be shared evenly by {kv} key/value heads: drawn with one "
                         "key/value head per query head")
            kv_line = f"{heads} heads of {HEAD_DIM}: {kv} key/value heads cannot share them, one each"
            kv = None
        degrees = tensor_parallel.valid_tp_degrees(h, heads, kv, limit=degree_slider.max)
        problem = tensor_parallel.tensor_parallel_size_problem(h, heads, t, kv)
        if problem:
            valid = min(degrees, key=lambda degree: (abs(degree - t), degree))
            refused.update(degree=valid, text=f"t = {t} refused: {problem}; moved to t = {valid}, the nearest "
                                              "degree that splits whole heads")
            degree_slider.value = valid  # redraws again, at the valid degree (connect: the last state wins)
            return
        if refused["degree"] == t:
            notes.insert(0, refused["text"])
        refused.update(degree=None, text="")
        peak = compute.GPUS[gpu_choice.value].peak_bf16_flops
        times = {label: [tensor_parallel.tensor_parallel_layer_time(
            b, s, h, n, peak, links[label] if n <= node_size else links[across]) for n in degrees]
            for label in links}
        chosen, link = times[link_choice.value][degrees.index(t)], link_choice.value.split(" (")[0]
        curves = {(label if label == across else f"{label}, {across.split(' (')[0]} past {node_size} GPUs"):
                  [time.communication_s for time in values] for label, values in times.items()}
        chosen_label = next(label for label in curves if label.startswith(link_choice.value))
        title = f"one layer, h = {h}, s = {s}, b = {b}, bf16, {gpu_choice.value}\n{kv_line}"
        figure = tensor_plots.plot_layer_time(degrees, [time.compute_s for time in times[across]], curves, t,
                                              chosen_label, node_size=node_size, title=title)
        picture.value = plots.figure_to_png(figure)
        if t == 1:
            text = f"t = 1, one GPU: {chosen.compute_s * 1e3:.3g} ms of compute per layer, no communication"
        else:
            crossing = link_choice.value != across and t > node_size
            text = (f"t = {t} over {link}" + (f" (past one node of {node_size} GPUs the ring crosses "
                                              f"{across.split(' (')[0]})" if crossing else "")
                    + f": compute {chosen.compute_s * 1e3:.3g} ms, communication {chosen.communication_s * 1e3:.3g} "
                      f"ms per layer, {chosen.communication_fraction:.0%} of its time; {chosen.collectives} "
                      f"all-reduces of b·s·h = {b * s * h * 2 / 1e6:,.1f} MB each")
        heads_text = f"{heads} heads of {HEAD_DIM}" + (f", {kv} key/value heads" if kv else "")
        notes.append(f"h = {h}: {heads_text}; t may be {', '.join(map(str, degrees))}")
        summary.value = f"<small>{text}<br>" + "<br>".join(notes) + "</small>"

    # The GPU first among the dropdowns: moving it away and back never moves another control (the browser
    # test's fresh draw), where the key/value heads may move t to a valid degree.
    connect((degree_slider, hidden_slider, sequence_slider, batch_slider, gpu_choice, link_choice, kv_choice),
            redraw)
    controls = widgets.HBox([widgets.VBox([degree_slider, hidden_slider, sequence_slider, batch_slider]),
                             widgets.VBox([gpu_choice, link_choice, kv_choice])], layout=ROW)
    return widgets.VBox([controls, summary, picture])
