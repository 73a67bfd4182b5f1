/**
 * The sidebar's state: the service, its tasks (kept live by their event streams), models,
 * pairing requests and paired clients. Views render it; `changed` says when to render again.
 *
 * While the panel is shown, everything is refreshed every few seconds and each unfinished task
 * (at most MAX_STREAMS at a time: browsers allow ~6 connections per host) is followed through
 * its event stream. While it is hidden, only pairing requests are polled, so the plugin can
 * notify the user of a new one.
 */

import { Signal } from '@lumino/signaling';
import type { ISignal } from '@lumino/signaling';

import { LMSPClient } from './api';
import { Coalesced } from './coalesce';
import { parseExposition, pointsOf, scrapeOf, startupRecovery } from './metrics';
import type { IPoint, IRecovered, IScrape } from './metrics';
import { registrationAfter } from './registration';
import type { IRegistration } from './registration';
import { LifecycleFollower, TaskFollower } from './sse';
import type { FollowMode } from './sse';
import { isTerminal, stateAfterEvent } from './taskstate';
import { WebhooksModel } from './webhooks';
import type {
  IClient,
  ILifecycleEvent,
  IModel,
  IPairing,
  IService,
  ITask,
  ITaskEvent
} from './types';

export const MAX_STREAMS = 4;
const REFRESH_MS = 2500;
const PAIRING_POLL_MS = 3000;
const TASK_PAGE = 20;
/** How far back the activity sparklines reach. */
export const ACTIVITY_WINDOW_MS = 5 * 60 * 1000;

/** The activity view: figures over the last minutes, from the service's metrics. */
export interface IActivity {
  points: IPoint[];
  queueDepth: number;
  active: number;
  recovered: IRecovered[];
}

/** A task as the sidebar shows it. */
export interface ITaskView {
  task: ITask;
  /** Characters of output text seen in the event stream (when followed from the start). */
  chars: number | null;
  /** Output tokens, from the terminal event's usage. */
  tokens: number | null;
  /** How its events arrive now. */
  mode: FollowMode;
  /** The last sequence number delivered by its event stream (-1: none yet). */
  seen: number;
  /** A model registration's stage, progress and outcome (`registration.ts`), from its
   * events; null for other tasks, and for one not followed from this sidebar. */
  registration: IRegistration | null;
}

export interface IMessage {
  kind: 'info' | 'error';
  text: string;
}

export interface ISection<T> {
  data: T;
  error: string | null;
  loaded: boolean;
}

function section<T>(data: T): ISection<T> {
  return { data, error: null, loaded: false };
}

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

export class SidebarModel {
  readonly client: LMSPClient;
  service: ISection<IService | null> = section(null);
  tasks: ISection<ITaskView[]> = section([]);
  models: ISection<IModel[]> = section([]);
  pairings: ISection<IPairing[]> = section([]);
  clients: ISection<IClient[]> = section([]);
  activity: ISection<IActivity | null> = section(null);
  readonly webhooks: WebhooksModel;
  /** Finished tasks older than the newest page, read page by page (`loadOlderTasks`). */
  olderTasks: ITaskView[] = [];
  /** Whether the service has tasks older than the ones listed. */
  moreTasks = false;
  /** The last outcome of a user action (register, cancel, approve, …). */
  message: IMessage | null = null;
  /** Keys of actions in flight (e.g. `cancel:task_…`), to disable their buttons. */
  readonly busy = new Set<string>();

  private readonly followers = new Map<string, TaskFollower>();
  private readonly views = new Map<string, ITaskView>();
  private scrapes: IScrape[] = [];
  /** The caller-wide lifecycle stream, while the panel is shown: the task list is not polled
   * while it is connected. */
  private lifecycle: LifecycleFollower | null = null;
  private lifecycleConnected = false;
  /** The metrics read again after a task transition (the queue line). */
  private readonly activityFollows = new Coalesced(async () => {
    await this.load('activity', () => this.scrapeMetrics());
  });
  private readonly seenPairings = new Set<string>();
  private active = false;
  private pairingFailures = 0;
  private pairingSkips = 0;
  private disposed = false;
  private refreshTimer: ReturnType<typeof setInterval> | null = null;
  private pairingTimer: ReturnType<typeof setInterval> | null = null;
  private tickTimer: ReturnType<typeof setInterval> | null = null;
  private readonly _changed = new Signal<this, void>(this);
  private readonly _pairingsArrived = new Signal<this, IPairing[]>(this);
  private readonly _pairingsGone = new Signal<this, string[]>(this);

  constructor(client?: LMSPClient) {
    this.client = client ?? new LMSPClient();
    this.webhooks = new WebhooksModel(this.client, () => this.emit());
  }

  /** Something to render changed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Pending pairing requests seen for the first time. */
  get pairingsArrived(): ISignal<this, IPairing[]> {
    return this._pairingsArrived;
  }

  /** Ids of pairing requests that are no longer pending (decided or expired). */
  get pairingsGone(): ISignal<this, string[]> {
    return this._pairingsGone;
  }

  get isActive(): boolean {
    return this.active;
  }

  /** Start the background pairing poll (for notifications). */
  start(): void {
    if (this.pairingTimer === null && !this.disposed) {
      this.pollPairings();
      this.pairingTimer = setInterval(() => this.pollPairings(), PAIRING_POLL_MS);
    }
  }

  /** One tick of the background poll: not while the browser tab is hidden; slower (up to a
   * minute) while the service does not answer, e.g. when the server extension is disabled. */
  private pollPairings(): void {
    if (this.active || document.visibilityState === 'hidden') {
      return; // the panel's own refresh polls them while it is shown
    }
    if (this.pairingSkips > 0) {
      this.pairingSkips -= 1;
      return;
    }
    void this.refreshPairings().then(ok => {
      this.pairingFailures = ok ? 0 : this.pairingFailures + 1;
      this.pairingSkips = Math.min(19, 2 ** this.pairingFailures - 1);
    });
  }

  /** The panel was shown (true) or hidden (false). */
  setActive(active: boolean): void {
    if (active === this.active || this.disposed) {
      return;
    }
    this.active = active;
    if (active) {
      // The list of tasks comes once the lifecycle stream is open (`onOpen`), then from it.
      void this.refresh(false);
      this.lifecycle = new LifecycleFollower({
        client: this.client,
        onOpen: () => void this.refreshTasks(),
        onEvent: event => this.onLifecycle(event),
        onConnected: connected => {
          this.lifecycleConnected = connected;
          this.emit();
        }
      }).start();
      this.refreshTimer = setInterval(() => {
        if (document.visibilityState !== 'hidden') {
          // Tasks are polled only while the lifecycle stream is down.
          void this.refresh(!this.lifecycleConnected);
        }
      }, REFRESH_MS);
      this.tickTimer = setInterval(() => this.emit(), 1000);
    } else {
      for (const timer of [this.refreshTimer, this.tickTimer]) {
        if (timer !== null) {
          clearInterval(timer);
        }
      }
      this.refreshTimer = this.tickTimer = null;
      this.lifecycle?.stop();
      this.lifecycle = null;
      this.lifecycleConnected = false;
      this.stopFollowers();
    }
  }

  dispose(): void {
    this.setActive(false);
    if (this.pairingTimer !== null) {
      clearInterval(this.pairingTimer);
      this.pairingTimer = null;
    }
    this.disposed = true;
    Signal.clearData(this);
  }

  /** Whether the task list follows the lifecycle stream (else it is polled). */
  get tasksLive(): boolean {
    return this.lifecycleConnected;
  }

  async refresh(tasks = true): Promise<void> {
    await Promise.all([
      this.load('service', () => this.client.service()),
      tasks ? this.refreshTasks() : Promise.resolve(),
      this.load('models', async () => (await this.client.models()).data),
      this.refreshPairings(),
      this.load('clients', async () => (await this.client.clients()).data),
      this.load('activity', () => this.scrapeMetrics()),
      this.webhooks.refresh()
    ]);
  }

  /** Read the metrics once more: the sparklines gain the interval since the last read. */
  private async scrapeMetrics(): Promise<IActivity> {
    const samples = parseExposition(await this.client.metrics());
    const now = Date.now();
    const scrape = scrapeOf(samples, now);
    this.scrapes = [...this.scrapes.filter(s => now - s.at <= ACTIVITY_WINDOW_MS), scrape];
    return {
      points: pointsOf(this.scrapes),
      queueDepth: scrape.queueDepth,
      active: scrape.active,
      recovered: startupRecovery(samples)
    };
  }

  // -- tasks -------------------------------------------------------------------------------

  async refreshTasks(): Promise<void> {
    await this.load('tasks', async () => {
      const page = await this.client.tasks(TASK_PAGE);
      if (!this.olderTasks.length) {
        this.moreTasks = page.has_more;
      }
      const fresh = page.data.map(task => this.merge(task));
      // An older page's task that the newest page now holds again is listed once.
      const ids = new Set(fresh.map(v => v.task.id));
      this.olderTasks = this.olderTasks.filter(v => !ids.has(v.task.id));
      return fresh;
    });
    this.follow();
  }

  /** The next page of older tasks (the API's `after` cursor: the last task listed). These are
   * finished (or are followed once listed on the newest page again), so they are not
   * followed; the lifecycle stream still updates them. */
  async loadOlderTasks(): Promise<void> {
    const listed = [...this.tasks.data, ...this.olderTasks];
    const last = listed[listed.length - 1];
    await this.act('older-tasks', async () => {
      const page = await this.client.tasks(TASK_PAGE, last?.task.id);
      const ids = new Set(listed.map(v => v.task.id));
      const fresh = page.data.filter(t => !ids.has(t.id)).map(task => this.merge(task));
      this.olderTasks = [...this.olderTasks, ...fresh];
      this.moreTasks = page.has_more;
      return null;
    });
  }

  /** A transition of one of the caller's tasks (the lifecycle stream). */
  private onLifecycle(event: ILifecycleEvent): void {
    // The queue line counts what the service holds: read it as the rows change.
    this.activityFollows.request();
    const view = this.views.get(event.task_id);
    const listed = view !== undefined && this.tasks.data.includes(view);
    if (!view || !listed) {
      // A task the list does not show yet (new, or older than the page): its object.
      void this.client
        .task(event.task_id)
        .then(task => {
          const fresh = this.merge(task);
          if (!this.tasks.data.includes(fresh)) {
            const sorted = [fresh, ...this.tasks.data].sort(
              (a, b) => b.task.created_at - a.task.created_at
            );
            this.tasks.data = sorted.slice(0, TASK_PAGE);
            // Pushed off the newest page: older pages start with it (none is skipped), or
            // there is now an older page to read.
            const dropped = sorted.slice(TASK_PAGE);
            if (this.olderTasks.length) {
              this.olderTasks = [...dropped, ...this.olderTasks];
            } else if (dropped.length) {
              this.moreTasks = true;
            }
          }
          this.follow();
          this.emit();
        })
        .catch(() => undefined); // gone already (deleted): nothing to show
      return;
    }
    if (event.task_sequence_number > view.task.last_sequence_number) {
      view.task = {
        ...view.task,
        state: event.state,
        last_sequence_number: event.task_sequence_number,
        updated_at: Date.now() / 1000
      };
    }
    if (isTerminal(event.state) && !this.followers.has(event.task_id)) {
      // Its object, for finished_at, usage and error (a followed task gets it on its end).
      void this.client
        .task(event.task_id)
        .then(task => {
          this.merge(task);
          this.emit();
        })
        .catch(() => undefined);
      if (view.task.kind === 'model') {
        void this.load('models', async () => (await this.client.models()).data);
      }
    }
    this.follow();
    this.emit();
  }

  /** The view of a task with a (possibly stale) task object from a list or a POST. */
  private merge(task: ITask): ITaskView {
    const view = this.views.get(task.id);
    if (!view) {
      const fresh: ITaskView = {
        task,
        chars: null,
        tokens: null,
        mode: 'idle',
        seen: -1,
        registration: null
      };
      this.views.set(task.id, fresh);
      return fresh;
    }
    // An event stream may be ahead of this object: keep whichever saw more of the log.
    if (task.last_sequence_number >= view.task.last_sequence_number) {
      view.task = {
        ...task,
        prompt_excerpt: task.prompt_excerpt ?? view.task.prompt_excerpt ?? null,
        output_tokens: task.output_tokens ?? view.task.output_tokens ?? null,
        incomplete_reason: task.incomplete_reason ?? view.task.incomplete_reason ?? null
      };
    }
    return view;
  }

  /** Follow unfinished tasks (oldest first, at most MAX_STREAMS) while the panel is shown. */
  private follow(): void {
    if (!this.active) {
      return;
    }
    const unfinished = this.tasks.data
      .filter(v => !isTerminal(v.task.state))
      .sort((a, b) => a.task.created_at - b.task.created_at);
    for (const view of unfinished) {
      if (this.followers.size >= MAX_STREAMS) {
        break;
      }
      if (this.followers.has(view.task.id)) {
        continue;
      }
      // From the start the first time (to count its text); after that, from the last event
      // the stream delivered (`Last-Event-ID`), not from the list's newer count.
      const after = view.chars === null ? -1 : view.seen;
      if (view.chars === null) {
        view.chars = 0;
      }
      const follower = new TaskFollower({
        client: this.client,
        taskId: view.task.id,
        after,
        onEvent: event => this.onTaskEvent(view, event),
        onMode: mode => {
          view.mode = mode;
          this.emit();
        },
        onDone: reason => {
          this.followers.delete(view.task.id);
          if (reason === 'terminal') {
            // The object itself, for finished_at and error.
            void this.client
              .task(view.task.id)
              .then(task => {
                this.merge(task);
                this.emit();
              })
              .catch(() => undefined); // the next refresh brings it
            if (view.task.kind === 'model') {
              // A registration finished: the model list changed.
              void this.load('models', async () => (await this.client.models()).data);
            }
          }
          if (reason !== 'stopped') {
            this.follow();
          }
        }
      });
      this.followers.set(view.task.id, follower);
      follower.start();
    }
  }

  private onTaskEvent(view: ITaskView, event: ITaskEvent): void {
    view.seen = event.sequence_number;
    const state = stateAfterEvent(event.type);
    // A replay after a reconnect may be behind the task object a list refresh brought.
    const current = event.sequence_number >= view.task.last_sequence_number;
    const task = { ...view.task };
    if (current) {
      task.last_sequence_number = event.sequence_number;
      if (state) {
        task.state = state;
      }
    }
    task.updated_at = Date.now() / 1000;
    view.task = task;
    if (
      event.type === 'response.output_text.delta' ||
      event.type === 'response.function_call_arguments.delta' ||
      event.type === 'response.custom_tool_call_input.delta'
    ) {
      view.chars = (view.chars ?? 0) + event.delta.length;
    }
    if (view.task.kind === 'model') {
      view.registration = registrationAfter(view.registration, event);
    }
    const tokens = 'response' in event ? event.response.usage?.output_tokens : undefined;
    if (typeof tokens === 'number') {
      view.tokens = tokens;
    }
    this.emit();
  }

  private stopFollowers(): void {
    for (const follower of this.followers.values()) {
      follower.stop();
    }
    this.followers.clear();
    for (const view of this.views.values()) {
      view.mode = 'idle';
    }
  }

  async cancel(taskId: string): Promise<void> {
    await this.act(`cancel:${taskId}`, async () => {
      const task = await this.client.cancelTask(taskId);
      this.merge(task);
      return null;
    });
  }

  // -- models ------------------------------------------------------------------------------

  async registerModel(source: string): Promise<boolean> {
    const path = source.trim();
    if (!path) {
      this.message = {
        kind: 'error',
        text: 'Give the path of a model directory or file, or hf://org/name.'
      };
      this.emit();
      return false;
    }
    return this.act('register', async () => {
      const result = await this.client.registerModel(path);
      await Promise.all([
        this.refreshTasks(),
        this.load('models', async () => (await this.client.models()).data)
      ]);
      return `Registering ${path} (task ${result.id.slice(-8)})…`;
    });
  }

  // -- pairings and clients ----------------------------------------------------------------

  async refreshPairings(): Promise<boolean> {
    const ok = await this.load('pairings', async () => (await this.client.pairings()).data);
    if (!ok) {
      return false;
    }
    const pending = this.pairings.data;
    const fresh = pending.filter(p => !this.seenPairings.has(p.id));
    const ids = new Set(pending.map(p => p.id));
    const gone = [...this.seenPairings].filter(id => !ids.has(id));
    for (const id of gone) {
      this.seenPairings.delete(id);
    }
    for (const p of fresh) {
      this.seenPairings.add(p.id);
    }
    if (gone.length) {
      this._pairingsGone.emit(gone);
    }
    if (fresh.length) {
      this._pairingsArrived.emit(fresh);
    }
    return true;
  }

  async approve(pairingId: string, scopes?: string[]): Promise<void> {
    await this.act(`pairing:${pairingId}`, async () => {
      const pairing = await this.client.approvePairing(pairingId, scopes);
      await Promise.all([
        this.refreshPairings(),
        this.load('clients', async () => (await this.client.clients()).data)
      ]);
      return `Approved "${pairing.client_name}" (${(pairing.granted_scopes ?? []).join(', ')}).`;
    });
  }

  async deny(pairingId: string): Promise<void> {
    await this.act(`pairing:${pairingId}`, async () => {
      const pairing = await this.client.denyPairing(pairingId);
      await this.refreshPairings();
      return `Denied "${pairing.client_name}".`;
    });
  }

  async revoke(clientId: string): Promise<void> {
    await this.act(`revoke:${clientId}`, async () => {
      const client = await this.client.revokeClient(clientId);
      await this.load('clients', async () => (await this.client.clients()).data);
      return `Revoked "${client.name}".`;
    });
  }

  /** Forget the last action's outcome (the user closed it). */
  clearMessage(): void {
    this.message = null;
    this.emit();
  }

  // -- plumbing ----------------------------------------------------------------------------

  private async load<
    K extends 'service' | 'tasks' | 'models' | 'pairings' | 'clients' | 'activity'
  >(
    key: K,
    get: () => Promise<this[K]['data']>
  ): Promise<boolean> {
    const target = this[key] as ISection<this[K]['data']>;
    try {
      target.data = await get();
      target.error = null;
      return true;
    } catch (error) {
      target.error = messageOf(error);
      return false;
    } finally {
      target.loaded = true;
      this.emit();
    }
  }

  /** Run a user action; its outcome (or the server's error message) becomes `message`. */
  private async act(key: string, run: () => Promise<string | null>): Promise<boolean> {
    if (this.busy.has(key)) {
      return false;
    }
    this.busy.add(key);
    this.emit();
    try {
      const text = await run();
      if (text !== null) {
        this.message = { kind: 'info', text };
      }
      return true;
    } catch (error) {
      this.message = { kind: 'error', text: messageOf(error) };
      return false;
    } finally {
      this.busy.delete(key);
      this.emit();
    }
  }

  private emit(): void {
    if (!this.disposed) {
      this._changed.emit();
    }
  }
}
