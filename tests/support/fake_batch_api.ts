/**
 * The Files and Batches endpoints of an OpenAI-compatible provider, for the fake model server
 * (`fake_model_server.ts`): `POST /v1/files` (multipart, `purpose=batch`, a JSONL file), `GET
 * /v1/files/{id}/content`, `POST /v1/batches` (with `metadata`), `GET /v1/batches/{id}`, `GET /v1/batches?after=`
 * (newest first, cursor pages) and `POST /v1/batches/{id}/cancel`, in the wire shapes of openai-node 6 (`Batch`,
 * `FileObject`, `CursorPage`, output and error lines `{id, custom_id, response: {status_code, request_id, body},
 * error}`). How each batch goes is scripted ({@linkcode BatchScript}): a delay before it ends, and each line
 * answered, refused (an error line), or left unfinished (an expired batch's `batch_expired` lines; its completed
 * lines are kept in its output file, as OpenAI keeps them), or failed (validation: no file at all). A hook ({@linkcode FakeBatchApiOptions.after}) runs after
 * each request's work is done and before its answer leaves, so a test can stop its client there: the provider
 * did the work, and the answer is lost. {@linkcode FakeBatchApi.failNext} makes an upload or a create answer an
 * error and do nothing: a refusal for good (a 4xx) or a transient failure (a 500).
 */
import {
  type ChatBody,
  completionBody,
  defaultAnswer,
  errorBody,
  realisticUsage,
  type Usage,
} from "./fake_model_server.ts";

/** What the provider does with one line of a batch. */
export type LineOutcome =
  | { kind: "ok"; content?: string; usage?: Usage }
  /** An error line: the request was answered with this status (a 400 is the model refusing it, a 500 transient). */
  | { kind: "error"; status: number; code?: string; message?: string }
  /** Not done when the batch ended: in an expired batch, a `batch_expired` line in the error file. */
  | { kind: "unfinished" };

/** How one batch goes. */
export interface BatchScript {
  /** How long it stays `in_progress` after its creation (default 0: it ends at its first retrieve). */
  delayMs?: number;
  /**
   * How it ends (default `completed`). `expired` keeps the lines that finished and reports the rest expired.
   * `failed` is a batch that failed validation (as a duplicate custom_id fails one): no output or error file, no
   * line reported, and the reason in its `errors` (`code`, default `invalid_request`).
   */
  end?: "completed" | "expired" | "failed";
  /** A `failed` batch's error: its code and message. */
  failure?: { code?: string; message?: string };
  /** Each line's outcome (default: answered). */
  line?: (customId: string, body: ChatBody, index: number) => LineOutcome;
}

/** A request the fake has done the work of, about to be answered (see {@linkcode FakeBatchApiOptions.after}). */
export type BatchApiStep =
  /** `POST /v1/files`: the file is stored. */
  | { step: "upload"; fileId: string; filename: string; lines: number }
  /** `POST /v1/batches`: the batch is created (its answer may still be a scripted loss, see `loseCreateReplies`). */
  | { step: "create"; batchId: string; metadata: Record<string, string> | null; customIds: readonly string[] }
  /** `GET /v1/batches/{id}`: its status as answered (an ended one has its files). */
  | { step: "retrieve"; batchId: string; status: string }
  /** `GET /v1/batches`: one page of the list. */
  | { step: "list"; batches: number }
  /**
   * `GET /v1/files/{id}/content`: the file read, and which it is: a batch's `output` or `error` file (with that
   * batch's id), or an uploaded `input` file.
   */
  | { step: "content"; fileId: string; file: "output" | "error" | "input"; batchId?: string };

/** An error answer scripted for an upload or a create (see {@linkcode FakeBatchApi.failNext}). */
export interface ScriptedFailure {
  status: number;
  /** The error document's message (default `scripted <status>`). */
  message?: string;
  /** The error document's code (default null). */
  code?: string;
  /** How many requests in a row get it (default 1). */
  times?: number;
}

/** Options of {@linkcode createFakeBatchApi}. */
export interface FakeBatchApiOptions {
  /**
   * Awaited after the fake did a request's work and before it answers: a test that kills its client here loses
   * the answer of a request the provider carried out. Not called for a request the fake refused (400, 404).
   */
  after?: (event: BatchApiStep) => void | Promise<void>;
}

/** One request line of a batch input file, as the Batch API reads it. */
interface InputLine {
  custom_id: string;
  method: string;
  url: string;
  body: ChatBody;
}

/** A stored file. */
interface StoredFile {
  id: string;
  purpose: string;
  filename: string;
  content: string;
  created_at: number;
}

/** A batch as the fake keeps it. */
interface StoredBatch {
  id: string;
  input_file_id: string;
  endpoint: string;
  completion_window: string;
  metadata: Record<string, string> | null;
  created_at: number;
  createdMs: number;
  script: BatchScript;
  /** The custom_ids of its input file's lines, in order. */
  customIds: string[];
  cancelled: boolean;
  /** Set once it ended: its status and files. */
  ended?: {
    status: "completed" | "expired" | "cancelled" | "failed";
    at: number;
    output_file_id?: string;
    error_file_id?: string;
    counts: { total: number; completed: number; failed: number };
    errors?: { object: "list"; data: { code: string; message: string; line: number | null; param: null }[] };
  };
}

/** The fake Files and Batches API. */
export interface FakeBatchApi {
  /** Answers a request under `/v1/files` or `/v1/batches`; undefined for any other path. */
  handle(req: Request, path: string): Promise<Response> | undefined;
  /** Requests each endpoint received. */
  readonly counts: {
    uploads: number;
    creates: number;
    retrieves: number;
    lists: number;
    cancels: number;
    contentReads: number;
  };
  /** Batches created, oldest first (their ids, metadata and the custom_ids of their lines), for assertions. */
  readonly batches: readonly {
    id: string;
    metadata: Record<string, string> | null;
    lines: number;
    customIds: readonly string[];
  }[];
  /** Request lines across every batch created, for assertions (a line sent twice is counted twice). */
  readonly linesSent: number;
  /**
   * Makes the next `n` `POST /v1/batches` create their batch and then answer `500`: a reply lost after the
   * provider did the work (the case that pays twice when the client simply retries).
   */
  loseCreateReplies(n: number): void;
  /**
   * Makes the next `times` `POST /v1/files` (`upload`) or `POST /v1/batches` (`create`) answer `status` with an
   * OpenAI error document, having done nothing: no file stored, no batch created, no `after` hook. Each is still
   * counted in {@linkcode counts}. A 4xx is a refusal (a 400 bad file, a 403, a 413 too large), a 500 a transient
   * failure. Failures scripted in turn are answered in that order.
   */
  failNext(step: "upload" | "create", failure: ScriptedFailure): void;
}

const CHAT_ENDPOINT = "/v1/chat/completions";

/** The fake API, each batch going as `script(n)` says (`n` counts batches created, from 1). */
export function createFakeBatchApi(
  script: (n: number) => BatchScript = () => ({}),
  { after = () => {} }: FakeBatchApiOptions = {},
): FakeBatchApi {
  const files = new Map<string, StoredFile>();
  const batches: StoredBatch[] = [];
  const counts = { uploads: 0, creates: 0, retrieves: 0, lists: 0, cancels: 0, contentReads: 0 };
  let linesSent = 0;
  let lostReplies = 0;
  const failures: Record<"upload" | "create", ScriptedFailure[]> = { upload: [], create: [] };
  /** The next scripted failure of `step` as a response, if one is due. */
  const scriptedFailure = (step: "upload" | "create"): Response | undefined => {
    const failure = failures[step].shift();
    if (!failure) return undefined;
    const type = failure.status >= 500 ? "server_error" : "invalid_request_error";
    const body = errorBody(failure.message ?? `scripted ${failure.status}`, type, failure.code ?? null);
    return Response.json(body, { status: failure.status });
  };
  const now = () => Math.floor(Date.now() / 1000);
  const id = (prefix: string) => `${prefix}${crypto.randomUUID().replaceAll("-", "")}`;

  const storeFile = (purpose: string, filename: string, content: string): StoredFile => {
    const file = { id: id("file-"), purpose, filename, content, created_at: now() };
    files.set(file.id, file);
    return file;
  };
  const linesOf = (f: StoredFile) =>
    f.content.split("\n").filter((l) => l.trim() !== "").map((l) => JSON.parse(l) as InputLine);
  const fileObject = (f: StoredFile) => ({
    id: f.id,
    object: "file",
    bytes: new TextEncoder().encode(f.content).length,
    created_at: f.created_at,
    filename: f.filename,
    purpose: f.purpose,
    status: "processed",
  });

  /** Ends the batch when its time has come (or it was cancelled): writes its output and error files. */
  const settle = (b: StoredBatch) => {
    if (b.ended) return;
    const due = performance.now() - b.createdMs >= (b.script.delayMs ?? 0);
    if (!due && !b.cancelled) return;
    const lines = linesOf(files.get(b.input_file_id)!);
    const seen = new Set<string>();
    const duplicate = lines.findIndex((l) => seen.size === seen.add(l.custom_id).size);
    const failed = (code: string, message: string, line: number | null) => {
      b.ended = {
        status: "failed",
        at: now(),
        counts: { total: 0, completed: 0, failed: 0 },
        errors: { object: "list", data: [{ code, message, line, param: null }] },
      };
    };
    if (duplicate >= 0) {
      // As OpenAI validates a file: a duplicate custom_id fails the whole batch, with no output.
      const custom = lines[duplicate]!.custom_id;
      return failed("duplicate_custom_id", `The custom_id '${custom}' is duplicated.`, duplicate + 1);
    }
    if (!b.cancelled && b.script.end === "failed") {
      const { code = "invalid_request", message = "scripted: the batch failed validation" } = b.script.failure ?? {};
      return failed(code, message, null);
    }
    const end = b.cancelled ? "cancelled" : b.script.end ?? "completed";
    const output: string[] = [];
    const errors: string[] = [];
    lines.forEach((l, i) => {
      const outcome = b.cancelled ? { kind: "unfinished" as const } : b.script.line?.(l.custom_id, l.body, i) ??
        { kind: "ok" as const };
      const lineId = id("batch_req_");
      const requestId = id("req_");
      if (outcome.kind === "ok") {
        const content = outcome.content ?? defaultAnswer(l.body);
        const usage = outcome.usage ?? realisticUsage(l.body, content);
        output.push(JSON.stringify({
          id: lineId,
          custom_id: l.custom_id,
          response: { status_code: 200, request_id: requestId, body: completionBody(content, l.body.model, usage) },
          error: null,
        }));
      } else if (outcome.kind === "error") {
        errors.push(JSON.stringify({
          id: lineId,
          custom_id: l.custom_id,
          response: {
            status_code: outcome.status,
            request_id: requestId,
            body: errorBody(
              outcome.message ?? `scripted ${outcome.status}`,
              outcome.status >= 500 ? "server_error" : "invalid_request_error",
              outcome.code ?? null,
            ),
          },
          error: null,
        }));
      } else {
        const code = end === "cancelled" ? "batch_cancelled" : "batch_expired";
        errors.push(JSON.stringify({
          id: lineId,
          custom_id: l.custom_id,
          response: null,
          error: { code, message: "This request could not be executed before the completion window expired." },
        }));
      }
    });
    // A batch with no successful line has no output file (kaapi#723's "completed with only an error file").
    const outputFile = output.length ? storeFile("batch_output", "output.jsonl", output.join("\n") + "\n") : undefined;
    const errorFile = errors.length ? storeFile("batch_output", "errors.jsonl", errors.join("\n") + "\n") : undefined;
    b.ended = {
      status: end,
      at: now(),
      output_file_id: outputFile?.id,
      error_file_id: errorFile?.id,
      counts: { total: lines.length, completed: output.length, failed: errors.length },
    };
  };

  const batchObject = (b: StoredBatch) => {
    settle(b);
    const e = b.ended;
    const status = e ? e.status : b.cancelled ? "cancelling" : "in_progress";
    return {
      id: b.id,
      object: "batch",
      endpoint: b.endpoint,
      errors: e?.errors ?? null,
      input_file_id: b.input_file_id,
      completion_window: b.completion_window,
      status,
      output_file_id: e?.output_file_id ?? null,
      error_file_id: e?.error_file_id ?? null,
      created_at: b.created_at,
      in_progress_at: b.created_at,
      expires_at: b.created_at + 24 * 3600,
      finalizing_at: e ? e.at : null,
      completed_at: e?.status === "completed" ? e.at : null,
      failed_at: e?.status === "failed" ? e.at : null,
      expired_at: e?.status === "expired" ? e.at : null,
      cancelling_at: b.cancelled ? b.created_at : null,
      cancelled_at: e?.status === "cancelled" ? e.at : null,
      request_counts: e?.counts ?? { total: 0, completed: 0, failed: 0 },
      metadata: b.metadata,
    };
  };

  const notFound = (what: string) =>
    Response.json(errorBody(`No such ${what}`, "invalid_request_error"), { status: 404 });

  const handle = async (req: Request, path: string): Promise<Response> => {
    const url = new URL(req.url);
    if (req.method === "POST" && path === "/files") {
      counts.uploads++;
      const form = await req.formData();
      const failed = scriptedFailure("upload");
      if (failed) return failed;
      const file = form.get("file");
      if (form.get("purpose") !== "batch" || !(file instanceof File)) {
        return Response.json(errorBody("purpose must be batch, with a file", "invalid_request_error"), { status: 400 });
      }
      const stored = storeFile("batch", file.name, await file.text());
      await after({
        step: "upload",
        fileId: stored.id,
        filename: stored.filename,
        lines: stored.content.split("\n").filter((l) => l.trim()).length,
      });
      return Response.json(fileObject(stored));
    }
    const content = path.match(/^\/files\/([^/]+)\/content$/);
    if (req.method === "GET" && content) {
      counts.contentReads++;
      const f = files.get(content[1]!);
      if (!f) return notFound("file");
      const of = batches.find((b) => b.ended?.output_file_id === f.id || b.ended?.error_file_id === f.id);
      await after({
        step: "content",
        fileId: f.id,
        file: of ? (of.ended!.output_file_id === f.id ? "output" : "error") : "input",
        ...(of ? { batchId: of.id } : {}),
      });
      return new Response(f.content, { headers: { "content-type": "application/octet-stream" } });
    }
    if (req.method === "POST" && path === "/batches") {
      counts.creates++;
      const body = await req.json() as {
        input_file_id?: string;
        endpoint?: string;
        completion_window?: string;
        metadata?: Record<string, string> | null;
      };
      const failed = scriptedFailure("create");
      if (failed) return failed;
      const input = body.input_file_id === undefined ? undefined : files.get(body.input_file_id);
      if (!input || body.endpoint !== CHAT_ENDPOINT || body.completion_window !== "24h") {
        return Response.json(errorBody("bad batch request", "invalid_request_error"), { status: 400 });
      }
      const b: StoredBatch = {
        id: id("batch_"),
        input_file_id: input.id,
        endpoint: body.endpoint,
        completion_window: body.completion_window,
        metadata: body.metadata ?? null,
        created_at: now(),
        createdMs: performance.now(),
        script: script(batches.length + 1),
        customIds: linesOf(input).map((l) => l.custom_id),
        cancelled: false,
      };
      batches.push(b);
      linesSent += b.customIds.length;
      await after({ step: "create", batchId: b.id, metadata: b.metadata, customIds: b.customIds });
      if (lostReplies > 0) {
        lostReplies--;
        return Response.json(errorBody("scripted: the reply was lost", "server_error"), { status: 500 });
      }
      return Response.json(batchObject(b));
    }
    if (req.method === "GET" && path === "/batches") {
      counts.lists++;
      const limit = Math.min(100, Number(url.searchParams.get("limit") ?? 20));
      const newest = [...batches].reverse();
      const cursor = url.searchParams.get("after");
      const start = cursor ? newest.findIndex((b) => b.id === cursor) + 1 : 0;
      const page = newest.slice(start, start + limit);
      const data = page.map(batchObject);
      await after({ step: "list", batches: page.length });
      return Response.json({
        object: "list",
        data,
        first_id: page[0]?.id ?? null,
        last_id: page.at(-1)?.id ?? null,
        has_more: start + limit < newest.length,
      });
    }
    const one = path.match(/^\/batches\/([^/]+)(\/cancel)?$/);
    if (one) {
      const b = batches.find((x) => x.id === one[1]);
      if (!b) return notFound("batch");
      if (req.method === "POST" && one[2]) {
        counts.cancels++;
        if (!b.ended) b.cancelled = true;
        return Response.json(batchObject(b));
      }
      if (req.method === "GET" && !one[2]) {
        counts.retrieves++;
        const answer = batchObject(b);
        await after({ step: "retrieve", batchId: b.id, status: answer.status });
        return Response.json(answer);
      }
    }
    return new Response("not found", { status: 404 });
  };

  return {
    handle(req, path) {
      return path.startsWith("/files") || path.startsWith("/batches") ? handle(req, path) : undefined;
    },
    counts,
    get batches() {
      return batches.map((b) => ({
        id: b.id,
        metadata: b.metadata,
        lines: b.customIds.length,
        customIds: b.customIds,
      }));
    },
    get linesSent() {
      return linesSent;
    },
    loseCreateReplies(n) {
      lostReplies += n;
    },
    failNext(step, failure) {
      for (let i = 0; i < (failure.times ?? 1); i++) failures[step].push(failure);
    },
  };
}
