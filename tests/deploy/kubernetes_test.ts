/**
 * deploy/kubernetes/: every manifest validates against the Kubernetes API's schemas (`kubernetes-models`, generated
 * from the Kubernetes OpenAPI document) and the ScaledObject against KEDA's CRD schema (`@kubernetes-models/keda`,
 * generated from KEDA's CRDs), strictly as `kubectl apply --validate=strict` does: a field its schema does not define
 * is refused too (./strict_fields.ts); and the manifests keep what the README promises: the three processes with their
 * permission-locked tasks, probes on /readyz and /healthz, the stop's grace, disruption budgets, non-root
 * read-only pods, and workers scaled on the summed backlog.
 */
import assert from "node:assert/strict";
import { parseAllDocuments } from "npm:yaml@2.8.1";
import { Namespace } from "npm:kubernetes-models@5.1.0/v1/Namespace";
import { ConfigMap } from "npm:kubernetes-models@5.1.0/v1/ConfigMap";
import { Service } from "npm:kubernetes-models@5.1.0/v1/Service";
import { Deployment } from "npm:kubernetes-models@5.1.0/apps/v1/Deployment";
import { Job } from "npm:kubernetes-models@5.1.0/batch/v1/Job";
import { PodDisruptionBudget } from "npm:kubernetes-models@5.1.0/policy/v1/PodDisruptionBudget";
import { ScaledObject } from "npm:@kubernetes-models/keda@2.0.0/keda.sh/v1alpha1/ScaledObject";
import { parseConfig } from "../../src/config.ts";
import type { Command } from "../../src/commands.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { validateStrict } from "./strict_fields.ts";

const DIR = new URL("../../deploy/kubernetes/", import.meta.url);
const tasks = JSON.parse(await Deno.readTextFile(new URL("../../deno.json", import.meta.url))).tasks;

// deno-lint-ignore no-explicit-any
type Manifest = any;
const MODELS: Record<string, new (data: Manifest) => { validate(): void }> = {
  "v1/Namespace": Namespace,
  "v1/ConfigMap": ConfigMap,
  "v1/Service": Service,
  "apps/v1/Deployment": Deployment,
  "batch/v1/Job": Job,
  "policy/v1/PodDisruptionBudget": PodDisruptionBudget,
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
};

const manifests: { file: string; doc: Manifest }[] = [];
for await (const entry of Deno.readDir(DIR)) {
  if (!entry.name.endsWith(".yaml")) continue;
  const text = await Deno.readTextFile(new URL(entry.name, DIR));
  for (const doc of parseAllDocuments(text)) {
    assert.deepEqual(doc.errors, [], entry.name);
    manifests.push({ file: entry.name, doc: doc.toJS({ maxAliasCount: 100 }) });
  }
}
const find = (kind: string, name: string) =>
  manifests.find((m) => m.doc.kind === kind && m.doc.metadata.name === name)!.doc;
const deployments = ["api", "worker", "relay"].map((name) => find("Deployment", `oncely-${name}`));

Deno.test("every manifest validates against its Kubernetes or KEDA schema, with no field the schema lacks", () => {
  assert.ok(manifests.length >= 12, `${manifests.length} manifests`);
  for (const { file, doc } of manifests) {
    const Model = MODELS[`${doc.apiVersion}/${doc.kind}`];
    assert.ok(Model, `${file}: a schema for ${doc.apiVersion} ${doc.kind}`);
    validateStrict(Model, doc);
  }
  // The validators have teeth: a port as a string, a probe without its handler's port, a ScaledObject without
  // its target or with a count as a string are refused.
  const broken = structuredClone(deployments[0]);
  broken.spec.template.spec.containers[0].ports[0].containerPort = "8000";
  assert.throws(() => new Deployment(broken).validate(), /containerPort must be integer/);
  const scaled = structuredClone(find("ScaledObject", "oncely-worker"));
  delete scaled.spec.scaleTargetRef.name;
  scaled.spec.minReplicaCount = "1";
  assert.throws(() => new ScaledObject(scaled).validate(), /minReplicaCount must be integer/);
  assert.throws(() => new ScaledObject(scaled).validate(), /scaleTargetRef must have required property name/);
  // Strictly: a misspelt field (which the validators alone let through) is refused by its path, as kubectl's
  // --validate=strict refuses it, in the Kubernetes schemas and in KEDA's; free keys (labels, a trigger's
  // metadata) stay free.
  const misspelt = structuredClone(deployments[0]);
  const [container] = misspelt.spec.template.spec.containers;
  container.readinesProbe = container.readinessProbe;
  delete container.readinessProbe;
  misspelt.spec.template.metadata.labels = { ...misspelt.spec.template.metadata.labels, "example.com/any": "x" };
  new Deployment(misspelt).validate();
  assert.throws(
    () => validateStrict(Deployment, misspelt),
    /^Error: Deployment oncely-api: unknown field "spec\.template\.spec\.containers\[0\]\.readinesProbe"$/,
  );
  const advanced = structuredClone(find("ScaledObject", "oncely-worker"));
  advanced.spec.advanced = { horizontalPodAutoScalerConfig: advanced.spec.advanced.horizontalPodAutoscalerConfig };
  advanced.spec.triggers[0].metadata.unsafeSsl = "false";
  new ScaledObject(advanced).validate();
  assert.throws(
    () => validateStrict(ScaledObject, advanced),
    /^Error: ScaledObject oncely-worker: unknown field "spec\.advanced\.horizontalPodAutoScalerConfig"$/,
  );
});

Deno.test("the three deployments run their permission-locked tasks with probes, the stop's grace, non-root", async () => {
  const config = find("ConfigMap", "oncely-config").data;
  // main.ts forces a stopping process out at GRACE_MS; the contract promises an exit within 10 s.
  const grace = Number(
    /const GRACE_MS = ([\d_]+);/.exec(await Deno.readTextFile(new URL("../../main.ts", import.meta.url)))![1]!
      .replaceAll("_", ""),
  );
  for (const [i, name] of (["api", "worker", "relay"] as const).entries()) {
    const d = deployments[i];
    const pod = d.spec.template.spec;
    const [container] = pod.containers;
    assert.deepEqual(container.command, ["deno", "task", name], `${name} runs as deno task ${name} does`);
    assert.equal(tasks[name], `deno task -q launch ${name}`, `deno task ${name} derives its set at start`);
    assert.equal(container.readinessProbe.httpGet.path, "/readyz");
    assert.equal(container.livenessProbe.httpGet.path, "/healthz");
    const port = container.ports.find((p: { name: string }) => p.name === container.readinessProbe.httpGet.port);
    assert.ok(port, `${name}: the probes name a port of the container`);
    assert.ok(pod.terminationGracePeriodSeconds * 1000 >= grace && pod.terminationGracePeriodSeconds <= 10, name);
    assert.equal(pod.securityContext.runAsNonRoot, true);
    assert.ok(pod.securityContext.runAsUser > 0);
    assert.equal(container.securityContext.readOnlyRootFilesystem, true);
    assert.equal(container.securityContext.allowPrivilegeEscalation, false);
    assert.deepEqual(container.securityContext.capabilities.drop, ["ALL"]);
    // Each pod's environment: the shared configuration, the secrets (a stand-in here), its own port.
    const env = {
      ...config,
      DATABASE_URL: "postgres://oncely:secret@postgres.oncely.svc.cluster.local:5432/oncely",
      METRICS_TOKEN: "a-token-of-16-characters",
      ...Object.fromEntries((container.env ?? []).map((e: { name: string; value: string }) => [e.name, e.value])),
    };
    const listen = name === "api" ? env.PORT : env.METRICS_PORT;
    assert.equal(Number(listen), port.containerPort, `${name} listens on its probes' port`);
    const flags = permissionFlags(name as Command, parseConfig(env), "/app/migrations");
    assert.ok(!flags.includes("-A"));
    if (name === "relay") {
      assert.ok(flags.some((f) => f.startsWith("--deny-net=") && f.includes("redis.oncely.svc.cluster.local:6379")));
    } else {
      const net = /--allow-net=(\S+)/.exec(flags.join(" "))![1]!.split(",").sort();
      assert.deepEqual(net, [
        `0.0.0.0:${port.containerPort}`,
        "postgres.oncely.svc.cluster.local:5432",
        "redis.oncely.svc.cluster.local:6379",
      ]);
    }
    // Its headless Service selects exactly its pods, for Prometheus.
    const metrics = find("Service", `oncely-${name}-metrics`);
    assert.equal(metrics.spec.clusterIP, "None");
    assert.deepEqual(metrics.spec.selector, d.spec.selector.matchLabels);
    // A disruption budget covers it.
    const pdb = find("PodDisruptionBudget", `oncely-${name}`);
    assert.deepEqual(pdb.spec.selector.matchLabels, d.spec.selector.matchLabels);
  }
});

Deno.test("KEDA scales the worker deployment on the summed backlog through its Prometheus scaler", () => {
  const scaled = find("ScaledObject", "oncely-worker");
  assert.deepEqual(scaled.spec.scaleTargetRef, { apiVersion: "apps/v1", kind: "Deployment", name: "oncely-worker" });
  const [trigger] = scaled.spec.triggers;
  assert.equal(scaled.spec.triggers.length, 1);
  assert.equal(trigger.type, "prometheus");
  assert.match(trigger.metadata.query, /max\(oncely_queue_waiting\)/);
  assert.equal(trigger.metadata.threshold, "32", "one worker per WORKER_CONCURRENCY (32 by default)");
  assert.ok(scaled.spec.minReplicaCount >= 1 && scaled.spec.maxReplicaCount > scaled.spec.minReplicaCount);
});
