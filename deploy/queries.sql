-- Kiln job history: example SQL questions (docs/ARCHITECTURE.md#job-store).
--
-- Every query runs unchanged on Postgres (production) and SQLite (the embedded default).
-- Each starts with a `-- name: <name>` line, then comment lines saying the question it answers.
-- Parameters are written `:name` (SQLAlchemy text(), aiosql, psql's `\set` + `:'name'`);
-- timestamps are UTC. In the sqlite3 shell, write them as text, e.g.
-- `datetime('now', '-7 days')`; in psql, `now() - interval '7 days'`.
--
-- Views (created by the migration 0002_people_views):
--   v_job_history                   one row per job: the filterable columns + queue_wait_seconds, duration_seconds
--   v_loss_curve                    one row per optimizer step: job_id, adapter_name, global_step, epoch, loss, ...
--   v_failures_by_reason            failure_reason, jobs, last_seen
--   v_throughput_by_rank_optimizer  lora_rank, optimizer_kind, jobs, steps, mean_step_ms, tokens_per_second
--   v_queue                         queued jobs with their 1-based FIFO position
-- View (created by the migration 0004_validation_evaluations):
--   v_validation_curve              one row per held-out validation evaluation: job_id, adapter_name,
--                                   global_step (0: the baseline), epoch, loss, token_accuracy, ...
-- Tables: training_jobs, prepared_sft_admissions, job_events, training_steps, checkpoints,
-- adapters, runners, validation_evaluations.

-- name: failed_oom_last_week
-- Which jobs failed because they ran out of memory since :since (e.g. one week ago), and how
-- big were they?
SELECT job_id, adapter_name, lora_rank, rows_kept, peak_memory_bytes, error_message, finished_at
FROM v_job_history
WHERE state = 'failed' AND failure_reason = 'oom' AND finished_at >= :since
ORDER BY finished_at DESC;

-- name: loss_curve
-- What is the loss curve of job :job_id, step by step?
SELECT global_step, epoch, loss, learning_rate, step_ms
FROM v_loss_curve
WHERE job_id = :job_id
ORDER BY global_step;

-- name: mean_step_time_by_rank
-- How long does one optimizer step take on average, by LoRA rank?
SELECT j.lora_rank, COUNT(DISTINCT s.job_id) AS jobs, COUNT(*) AS steps, AVG(s.step_ms) AS mean_step_ms
FROM training_steps s
JOIN training_jobs j ON j.id = s.job_id
GROUP BY j.lora_rank
ORDER BY j.lora_rank;

-- name: failures_by_reason
-- Why do jobs fail, how often, and when did each reason last happen?
SELECT failure_reason, jobs, last_seen
FROM v_failures_by_reason
ORDER BY jobs DESC, failure_reason;

-- name: queue_depth
-- How many jobs are waiting, and since when has the oldest one waited?
SELECT COUNT(*) AS queued, MIN(submitted_at) AS oldest_submitted_at
FROM training_jobs
WHERE state = 'queued' AND deleted_at IS NULL;

-- name: queue
-- Which jobs are waiting, in the order the worker will take them?
SELECT position, job_id, adapter_name, submitted_at
FROM v_queue
ORDER BY position;

-- name: final_loss_by_optimizer
-- Which optimizer ends with the lowest loss? Completed jobs per optimizer with their final loss.
SELECT optimizer_kind, COUNT(*) AS jobs, AVG(final_loss) AS mean_final_loss, MIN(final_loss) AS best_final_loss
FROM v_job_history
WHERE state = 'completed'
GROUP BY optimizer_kind
ORDER BY optimizer_kind;

-- name: slowest_jobs
-- Which completed jobs took the longest to train (trainer wall clock), and how big were they?
SELECT job_id, adapter_name, wall_clock_ms, rows_kept, epochs, lora_rank, total_steps
FROM v_job_history
WHERE state = 'completed'
ORDER BY wall_clock_ms DESC, job_id
LIMIT :limit;

-- name: throughput_by_rank_optimizer
-- What training throughput (tokens per second) does each rank and optimizer reach?
SELECT lora_rank, optimizer_kind, jobs, steps, mean_step_ms, tokens_per_second
FROM v_throughput_by_rank_optimizer
ORDER BY lora_rank, optimizer_kind;

-- name: peak_memory_by_rank
-- How much device memory did completed jobs need at most, by LoRA rank (for capacity planning)?
SELECT lora_rank, COUNT(*) AS jobs, MAX(peak_memory_bytes) AS max_peak_memory_bytes
FROM v_job_history
WHERE state = 'completed' AND peak_memory_bytes IS NOT NULL
GROUP BY lora_rank
ORDER BY lora_rank;

-- name: retried_jobs
-- Which jobs needed more than one attempt (a worker died under them), and how did they end?
SELECT job_id, adapter_name, attempts, state, failure_reason
FROM v_job_history
WHERE attempts > 1
ORDER BY attempts DESC, job_id;

-- name: running_jobs
-- What is running right now, how far along is it, and when did its worker last report?
SELECT id AS job_id, adapter_name, worker_id, global_step, total_steps, current_loss, heartbeat_at, cancel_requested
FROM training_jobs
WHERE state = 'running'
ORDER BY started_at;

-- name: adapter_lineage
-- Which job produced adapter :adapter_name, with which settings, and what did it reach?
SELECT a.name AS adapter_name, a.path, a.size_bytes, j.id AS job_id, j.optimizer_kind, j.learning_rate,
       j.lora_rank, j.lora_alpha, j.epochs, j.rows_kept, j.effective_seed, j.final_loss
FROM adapters a
JOIN training_jobs j ON j.id = a.job_id
WHERE a.name = :adapter_name AND a.deleted_at IS NULL;

-- name: validation_curve
-- What is the held-out validation curve of job :job_id, evaluation by evaluation (step 0 is the
-- baseline: the base model, before the first update)?
SELECT global_step, epoch, loss, token_accuracy, supervised_tokens, evaluated_at
FROM v_validation_curve
WHERE job_id = :job_id
ORDER BY global_step;

-- name: validation_by_job
-- Did the adapter learn or only memorise? For each job with held-out validation: the baseline
-- validation loss, the newest and the best one, and how many evaluations were made.
SELECT
    c.job_id,
    c.adapter_name,
    MIN(CASE WHEN c.global_step = 0 THEN c.loss END) AS baseline_loss,
    (SELECT l.loss FROM v_validation_curve l WHERE l.job_id = c.job_id
     ORDER BY l.global_step DESC LIMIT 1) AS latest_loss,
    MIN(c.loss) AS best_loss,
    MAX(c.global_step) AS latest_step,
    COUNT(*) AS evaluations
FROM v_validation_curve c
GROUP BY c.job_id, c.adapter_name
ORDER BY c.job_id;
