"""Settings no part of a run reads: refused in one line naming who reads them when typed on the command line, a
warning when a flagfile brings them; and every value checked by its owner's checks whether or not it is read."""

import json

import pytest

from tests.helpers import launch

STEPPING = "--mode=continuous_eval, --mode=ensemble, --mode=eval, --mode=train and --mode=tune)"


def _with_flagfile(tmp_path, lines, *args):
    """launch.py with a recipe's flagfile holding `lines` before `args`."""
    flags = tmp_path / "recipe.flags"
    flags.write_text("".join(line + "\n" for line in lines))
    return launch(f"--flagfile={flags}", *args)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--task=classification", "--gan_critic_steps=3"], "--gan_critic_steps=3: no part of this run reads it (read "
         "by --task=gan)"),
        (["--model=mlp", "--gpt_layers=3"], "--gpt_layers=3: no part of this run reads it (read by --model=gpt)"),
        # The ResNet has no dropout: --dropout=0.3 trained it as without, unsaid, and stood in its config.json.
        (["--model=resnet", "--dropout=0.3"], "--dropout=0.3: no part of this run reads it (read by --model=gpt, "
         "--model=mlp, --model=transformer and --task=gan)"),
        (["--optimizer=adamw", "--momentum=0.5"], "--momentum=0.5: no part of this run reads it (read by "
         "--optimizer=sgd)"),
        # Without --lr_scaling=linear the rate was not scaled, silently: the batch the rate was tuned for is unread.
        (["--base_batch_size=32"], "--base_batch_size=32: no part of this run reads it (read by --lr_scaling=linear)"),
        (["--dataset=digits", "--synthetic_classes=5"], "--synthetic_classes=5: no part of this run reads it (read by "
         "--dataset=synthetic)"),
        (["--sam_rho=inf"], "--sam_rho=inf: must be in [0.0, 10.0]"),
        (["--gan_latent=0"], "--gan_latent=0: must be a positive number"),
        (["--warmup_steps=5000"], "--warmup_steps=5000: must be less than --train_steps=1000"),
        (["--histogram_every=10"], "--histogram_every=10: no part of this run "
         "reads it (read by --actions=histograms)"),
        # Without --strategy=tpu the run trained on this machine's CPU, saying nothing of the TPU it was given.
        (["--tpu=local"], "--tpu=local: no part of this run reads it (read by --cluster_resolver=tpu and "
         "--strategy=tpu)"),
        (["--strategy=multi_worker", "--local_workers=2", "--num_ps=2"], "--num_ps=2: no part of this run reads it "
         "(read by --strategy=parameter_server)"),
        (["--slurm_port_base=9000"], "--slurm_port_base=9000: no part of this run reads it (read by "
         "--cluster_resolver=slurm)"),
        # Accepted before, recorded in config.json as if the run sampled so, and searched by a tuner: only
        # --mode=sample reads it.
        (["--task=language_model", "--sample_length=7"], "--sample_length=7: no part of this run reads it (read by "
         "--mode=sample of --task=language_model)"),
    ],
    ids=[
        "task", "model", "dropout", "optimizer", "base_batch_size", "source", "sam_rho", "gan_latent", "warmup",
        "action", "tpu", "num_ps", "slurm",
        "sample",
    ],
)  # fmt: skip
def test_a_setting_no_part_of_the_run_reads_is_refused_naming_its_readers(tmp_path, args, line):
    result = launch(*args, f"--workdir={tmp_path / 'run'}")
    assert (result.returncode, result.stderr.splitlines()) == (2, [f"error: {line}"])
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_flagfile_of_another_task_warns_for_the_settings_it_drops(tmp_path):
    result = launch(
        "--flagfile=experiments/digits_gan.flags",
        "--task=classification",
        "--train_steps=2",
        "--steps_per_loop=1",
        "--jit_compile=false",
        f"--workdir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: --gan_critic_steps=2 (from a flagfile): no part of this run reads it (read by --task=gan)",
        "warning: --gan_latent=16 (from a flagfile): no part of this run reads it (read by --task=gan)",
    ]


def test_a_flag_the_tune_space_searches_typed_on_the_command_line_is_refused(tmp_path):
    # Every trial drew its own learning rate: --learning_rate=0.5 changed nothing, without a word.
    space = tmp_path / "lr.space"
    space.write_text("learning_rate log 1e-3 1e-1\n")
    args = ("--mode=tune", f"--tune_space={space}", "--tune_pruner=none", f"--workdir={tmp_path / 'study'}")
    result = launch(*args, "--learning_rate=0.5")
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [
            f"error: --learning_rate=0.5: --tune_space={space} searches it: every trial draws its own, which this "
            "value would not change; drop the flag, or its line in the space"
        ],
    )
    assert not (tmp_path / "study").exists()
    # A recipe's flagfile gives its starting point, which the space's draws replace (docs/research.md's ResNet):
    # taken, and the tuner goes on to what it checks next (--tune_trials=0 is refused after).
    result = _with_flagfile(tmp_path, ["--learning_rate=0.5"], *args, "--tune_trials=0")
    assert (result.returncode, result.stderr.splitlines()[-1][:22]) == (2, "error: --tune_trials=0")


def test_num_ps_beside_a_tf_config_cluster_of_another_size_is_refused(monkeypatch):
    # The cluster TF_CONFIG gave ran with its one parameter server; --num_ps=3 changed nothing, without a word.
    from engine.settings.errors import ConfigError
    from tests.helpers import make_config

    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    for strategy in ("parameter_server", ""):  # given, or TF_CONFIG's 'ps' job chose it
        with pytest.raises(ConfigError) as error:
            make_config("", strategy=strategy, num_ps=3)
        assert str(error.value) == (
            "--num_ps=3: the cluster is TF_CONFIG's, whose 'ps' job lists 1 parameter server: --num_ps sizes only "
            "the clusters --local_workers and --cluster_resolver=slurm make; drop it"
        )
    cluster["ps"].append("localhost:4")  # a task --local_workers started: its --num_ps is its TF_CONFIG's
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    assert make_config("", strategy="parameter_server", num_ps=2).num_ps == 2
    assert make_config("", strategy="parameter_server").num_ps == 1  # the default: not given
    assert make_config("", strategy="parameter_server", cluster_resolver="slurm", num_ps=3).num_ps == 3


_PS_TASK = {"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "worker", "index": 0}}


@pytest.mark.parametrize("tf_config", ["garbage", json.dumps(_PS_TASK)])
def test_local_workers_do_not_read_a_tf_config_the_shell_left_set(monkeypatch, tf_config):
    # Refused for TF_CONFIG's faults ("not valid JSON"; "runs no 'ps' job ...: use --strategy=parameter_server"),
    # though the launcher gives each task a TF_CONFIG of its own.
    from tests.helpers import make_config

    monkeypatch.setenv("TF_CONFIG", tf_config)
    assert make_config("", strategy="multi_worker", local_workers=2).local_workers == 2


@pytest.mark.parametrize(
    "args, line",
    [
        (["--mode=eval", "--sample_length=3"], "--sample_length=3: no part of this run reads it (read by --mode=sample "
         "of --task=language_model)"),
        (["--mode=eval", "--export_dir=elsewhere"], "--export_dir=elsewhere: no part of this run reads it (read by "
         "--mode=export)"),
        (["--mode=export", "--eval_timeout=5"], "--eval_timeout=5.0: no part of this run reads it (read by "
         "--mode=continuous_eval)"),
        (["--mode=continuous_eval", "--checkpoint=ckpt-20"], "--checkpoint=ckpt-20: no part of this run reads it "
         "(read by --mode=eval, --mode=export and --mode=sample)"),
        (["--mode=eval", "--tpu=local"], "--tpu=local: no part of this run reads it (read by --cluster_resolver=tpu "
         "and --strategy=tpu)"),
        # Training's settings, evaluation's and a strategy's, taken silently by a mode that reads none of them.
        (["--mode=eval", "--steps_per_loop=5"], "--steps_per_loop=5: no part of this run reads it (read by "
         "--mode=train and --mode=tune)"),
        (["--mode=export", "--keep_checkpoints=1"], "--keep_checkpoints=1: no part of this run reads it (read by "
         "--mode=train and --mode=tune)"),
        (["--mode=eval", "--train_steps=5"], "--train_steps=5: no part of this run reads it (read by "
         "--mode=continuous_eval, --mode=train and --mode=tune)"),
        (["--mode=sample", "--eval_split=validation"], "--eval_split=validation: no part of this run reads it (read "
         "by --mode=continuous_eval, --mode=ensemble, --mode=eval, --mode=train and --mode=tune)"),
        (["--mode=sample", "--eval_batch_size=8"], "--eval_batch_size=8: no part of this run reads it (read by "
         "--mode=continuous_eval, --mode=eval, --mode=train and --mode=tune)"),
        (["--mode=export", "--strategy=mirrored"], "--strategy=mirrored: no part of this run reads it (read by "
         "--mode=continuous_eval, --mode=eval, --mode=train and --mode=tune)"),
        (["--mode=sample", "--num_cpu_devices=2"], "--num_cpu_devices=2: no part of this run reads it (read by "
         "--mode=continuous_eval, --mode=eval, --mode=train and --mode=tune)"),
        (["--mode=eval", "--histogram_every=5"], "--histogram_every=5: no part of this run reads it (read by "
         "--mode=train and --mode=tune of --actions=histograms)"),
        # Taken, and unread: an export or a sample runs no step (the compile cache's folder was made all the same);
        # an evaluation waited --connect_timeout for a dispatcher that serves only training batches.
        (["--mode=export", "--jit_compile=true"], "--jit_compile=true: no part of this run reads it (read by "
         f"{STEPPING}"),
        (["--mode=export", "--compile_cache=cache"], f"--compile_cache=cache: no part of this run reads it (read by "
         f"{STEPPING}"),
        (["--mode=sample", "--global_batch_size=64"], "--global_batch_size=64: no part of this run reads it (read "
         f"by {STEPPING}"),
        (["--mode=eval", "--tf_data_service=grpc://h:1"], "--tf_data_service=grpc://h:1: no part of this run reads "
         "it (read by --mode=train and --mode=tune)"),
    ],
    ids=[
        "sample_in_eval", "export_dir_in_eval", "eval_timeout_in_export", "checkpoint_in_a_sidecar", "tpu_in_eval",
        "steps_per_loop_in_eval", "keep_checkpoints_in_export", "train_steps_in_eval", "eval_split_in_sample",
        "eval_batch_size_in_sample", "strategy_in_export", "num_cpu_devices_in_sample", "action_setting_in_eval",
        "jit_compile_in_export", "compile_cache_in_export", "global_batch_size_in_sample", "data_service_in_eval",
    ],
)  # fmt: skip
def test_a_setting_of_another_mode_is_refused_as_train_refuses_one(tmp_path, args, line):
    # Each was taken silently: the evaluation ran, its --sample_length, --export_dir or --tpu unread (an export on one
    # device whatever --strategy said, an evaluation whatever --steps_per_loop or --train_steps said).
    result = launch(*args, f"--workdir={tmp_path / 'run'}")
    assert (result.returncode, result.stderr.splitlines()) == (2, [f"error: {line}"])


def test_a_flagfiles_setting_of_another_mode_is_warned_of_and_sample_reads_checkpoint(tmp_path):
    result = _with_flagfile(tmp_path, ["--sample_length=7"], "--mode=eval", f"--workdir={tmp_path / 'run'}")
    assert result.stderr.splitlines() == [
        "warning: --sample_length=7 (from a flagfile): no part of this run reads it (read by --mode=sample of "
        "--task=language_model)",
        f"error: --workdir={tmp_path / 'run'}: no checkpoint to use (train first, or pass --checkpoint)",
    ]
    # --mode=sample reads --checkpoint (refused before as read by eval and export alone, in a train run's words).
    result = launch("--mode=sample", f"--checkpoint={tmp_path / 'ckpt-20'}", f"--workdir={tmp_path / 'run'}")
    assert result.stderr.splitlines()[-1] == (
        f"error: --checkpoint={tmp_path / 'ckpt-20'}: no such checkpoint (expected {tmp_path / 'ckpt-20'}.index)"
    )


def test_a_setting_the_trained_run_does_not_read_is_refused_by_its_evaluation(tmp_path):
    # Taken silently before: an eval of an adamw run with --momentum, an export of an mlp with --gpt_layers.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"optimizer": "adamw", "model": "mlp"}')
    for args, line in (
        (
            ["--mode=eval", "--momentum=0.5"],
            "--momentum=0.5: no part of {run}'s run reads it (read by --optimizer=sgd)",
        ),
        (["--mode=export", "--gpt_layers=2"], "--gpt_layers=2: no part of {run}'s run reads it (read by --model=gpt)"),
    ):
        result = launch(*args, f"--workdir={run}")
        assert (result.returncode, result.stderr.splitlines()) == (2, [f"error: {line.format(run=run)}"])
    # The recipe that trained it (a flagfile, as a GAN's reused for a classifier) is warned of, as train warned of it:
    # its evaluation was refused.
    result = _with_flagfile(tmp_path, ["--momentum=0.5"], "--mode=eval", f"--workdir={run}")
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [
            f"warning: --momentum=0.5 (from a flagfile): no part of {run}'s run reads it (read by --optimizer=sgd)",
            f"error: --workdir={run}: no checkpoint to use (train first, or pass --checkpoint)",
        ],
    )


def test_what_each_mode_reads_is_taken_and_a_flagfiles_training_settings_are_warned_of(tmp_path):
    # Evaluation reads its split, batch and strategy; a sidecar --train_steps (the step it stops after): each goes on
    # to the empty workdir's error.
    workdir = tmp_path / "run"
    for args in (
        ["--mode=eval", "--eval_split=validation", "--eval_batch_size=8", "--strategy=one_device"],
        ["--mode=continuous_eval", "--train_steps=5", "--eval_timeout=0", "--num_cpu_devices=2"],
    ):
        result = launch(*args, f"--workdir={workdir}")
        assert (result.returncode, len(result.stderr.splitlines())) == (2, 1), (args, result.stderr)
        assert "no part of this run reads it" not in result.stderr, (args, result.stderr)
    # A training recipe reused to export its run (experiments/digits_gan.flags --mode=export): warned of, not refused.
    result = _with_flagfile(
        tmp_path, ["--train_steps=40", "--checkpoint_every=10"], "--mode=export", f"--workdir={workdir}"
    )
    assert result.stderr.splitlines() == [
        "warning: --checkpoint_every=10 (from a flagfile): no part of this run reads it (read by --mode=train and "
        "--mode=tune)",
        "warning: --train_steps=40 (from a flagfile): no part of this run reads it (read by --mode=continuous_eval, "
        "--mode=train and --mode=tune)",
        f"error: --workdir={workdir}: no checkpoint to use (train first, or pass --checkpoint)",
    ]
