/**
 * What a task's events say about its state (docs/protocol.md, "Task states and events").
 *
 * The map is the service's own (jupyter_lmsp.protocol.states.EVENT_STATES): the OpenAPI
 * document lists, per task state, the event types that move a task to it (`QueuedEventType`,
 * ...), and openapi-typescript exports those enums as the value arrays imported here. Nothing
 * is copied by hand; tests/test_event_states.py runs this module with node and fails if it
 * disagrees with the Python map.
 */

import {
  cancelledEventTypeValues,
  cancellingEventTypeValues,
  completedEventTypeValues,
  failedEventTypeValues,
  loadingEventTypeValues,
  queuedEventTypeValues,
  runningEventTypeValues,
  terminalEventTypeValues
} from './generated/lmsp';
import type { TaskState } from './types';

// Keyed by every TaskState, so a state the document adds fails to compile until it is listed.
const EVENTS_BY_STATE: Readonly<Record<TaskState, readonly string[]>> = {
  queued: queuedEventTypeValues,
  loading: loadingEventTypeValues,
  running: runningEventTypeValues,
  cancelling: cancellingEventTypeValues,
  completed: completedEventTypeValues,
  failed: failedEventTypeValues,
  cancelled: cancelledEventTypeValues
};

const EVENT_STATES: ReadonlyMap<string, TaskState> = new Map(
  (Object.entries(EVENTS_BY_STATE) as [TaskState, readonly string[]][]).flatMap(
    ([state, types]) => types.map(type => [type, state] as const)
  )
);

const TERMINAL_EVENT_TYPES: ReadonlySet<string> = new Set(terminalEventTypeValues);

export const TERMINAL_STATES: ReadonlySet<string> = new Set(
  terminalEventTypeValues.flatMap(type => EVENT_STATES.get(type) ?? [])
);

/** The task state an event moves the task to, or null for an event that is no transition. */
export function stateAfterEvent(type: string): TaskState | null {
  return EVENT_STATES.get(type) ?? null;
}

/** The last event of a task's log: nothing follows it. */
export function isTerminalEvent(type: string): boolean {
  return TERMINAL_EVENT_TYPES.has(type);
}

export function isTerminal(state: string): boolean {
  return TERMINAL_STATES.has(state);
}

/** What a task's badge says and its colour class, the words of the notebook widgets
 * (jupyter_lmsp/widgets/static/watcher.js `outcome`): a completed task whose response is
 * incomplete says "incomplete: <reason>" (amber), a failed one names its code (red). */
export function outcome(task: {
  state: string;
  incomplete_reason?: string | null;
  error?: { code?: string | null } | null;
}): { word: string; cls: string } {
  if (task.state === 'completed' && task.incomplete_reason) {
    return { word: `incomplete: ${task.incomplete_reason}`, cls: 'incomplete' };
  }
  if (task.state === 'failed' && task.error?.code) {
    return { word: `failed: ${task.error.code}`, cls: 'failed' };
  }
  return { word: task.state, cls: task.state };
}
